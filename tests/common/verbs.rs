//! Which verbs provider an RDMA suite runs on: kvring's simulated one
//! (default), or the real one, `IbVerbs`, over the fake libibverbs of
//! tests/fakes/ibverbs when `RDMA_TEST_PROVIDER=ibverbs` (what
//! .ci/stage-fakeverbs.sh sets, with the fake on LD_LIBRARY_PATH). A test
//! that needs what only the simulator has (its fault injection, its
//! per-NIC byte counters, devices made up per test) runs that part on the
//! simulator and says, on the real provider, what it skipped and why.

use kvring::rdma::{IbVerbs, SimVerbs, Verbs};
use kvring::EngineBuilder;
use std::sync::Arc;

/// The provider a suite's engines share, and the NICs they are given.
#[derive(Clone)]
pub enum Provider {
    /// The simulated provider.
    Sim(Arc<SimVerbs>),
    /// IbVerbs over the fake libibverbs, with the devices to name.
    Real(Arc<IbVerbs>, Vec<String>),
}

impl Provider {
    /// The provider the environment asks for, with one NIC.
    pub fn new() -> Self {
        Self::with_nics(1)
    }

    /// As [`Provider::new`], with `nics` NICs (the simulator's `sim0`,
    /// `sim1`..., or the fake's `fakeroce0`, `fakeroce1`).
    pub fn with_nics(nics: usize) -> Self {
        if std::env::var("RDMA_TEST_PROVIDER").as_deref() == Ok("ibverbs") {
            let verbs = IbVerbs::new();
            let listed = verbs.devices().unwrap_or_else(|e| panic!("RDMA_TEST_PROVIDER=ibverbs without the fake: {e}"));
            let names: Vec<String> = (0..nics).map(|i| format!("fakeroce{i}")).collect();
            for name in &names {
                assert!(listed.iter().any(|d| &d.name == name), "the fake lists no {name} (FAKE_IBVERBS_DEVICES)");
            }
            return Provider::Real(Arc::new(verbs), names);
        }
        let devices = (0..nics).map(|i| SimVerbs::device(&format!("sim{i}"), Some(0))).collect();
        Provider::Sim(Arc::new(if nics == 1 { SimVerbs::new() } else { SimVerbs::with_devices(devices) }))
    }

    /// The provider, as engines take it.
    pub fn verbs(&self) -> Arc<dyn Verbs> {
        match self {
            Provider::Sim(sim) => sim.clone(),
            Provider::Real(ib, _) => ib.clone(),
        }
    }

    /// `builder` with this provider and its NICs.
    pub fn apply(&self, builder: EngineBuilder) -> EngineBuilder {
        match self {
            Provider::Sim(sim) => builder.rdma(sim.clone()),
            Provider::Real(ib, names) => builder.rdma(ib.clone()).rdma_devices(names.clone()),
        }
    }

    /// The simulator, for what only it can do; on the real provider `None`,
    /// with `skipped` printed as the reason.
    pub fn sim_only(&self, skipped: &str) -> Option<&Arc<SimVerbs>> {
        match self {
            Provider::Sim(sim) => Some(sim),
            Provider::Real(..) => {
                eprintln!("skipped on the real provider over the fake libibverbs: {skipped}");
                None
            }
        }
    }
}
