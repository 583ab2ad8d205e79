//! Which verbs provider an RDMA suite runs on: kvring's simulated one
//! (default), or the real one, `IbVerbs`, over the fake libibverbs of
//! tests/fakes/ibverbs when `RDMA_TEST_PROVIDER=ibverbs` (what
//! .ci/stage-fakeverbs.sh sets, with the fake on LD_LIBRARY_PATH), or over a
//! host's own libibverbs and the NICs `RDMA_TEST_DEVICES` names
//! (benches/rdma_check.sh). What a test asks of the fabric beyond the
//! verbs (a fault on demand, bytes per NIC, a registration's rights) goes
//! to the [`Referee`]: the simulator, or the fake's `fake_ibverbs_*`
//! symbols. What only the simulator can do, a test runs there and says, on
//! the real provider, what it skipped and why.

use kvring::rdma::{IbVerbs, SimVerbs, Verbs, WcStatus};
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
    /// `sim1`..., or the fake's `fakeroce0`, `fakeroce1`; on a host with
    /// NICs, those `RDMA_TEST_DEVICES` names, comma-separated:
    /// benches/rdma_check.sh). `None`, with the reason printed, when fewer
    /// are named.
    pub fn try_with_nics(nics: usize) -> Option<Self> {
        if std::env::var("RDMA_TEST_PROVIDER").as_deref() == Ok("ibverbs") {
            let verbs = IbVerbs::new();
            let listed =
                verbs.devices().unwrap_or_else(|e| panic!("RDMA_TEST_PROVIDER=ibverbs without libibverbs: {e}"));
            let names: Vec<String> = match std::env::var("RDMA_TEST_DEVICES") {
                Ok(named) => named.split(',').filter(|n| !n.is_empty()).take(nics).map(str::to_string).collect(),
                Err(_) => (0..nics).map(|i| format!("fakeroce{i}")).collect(),
            };
            if names.len() < nics {
                eprintln!("skipped: needs {nics} NICs, RDMA_TEST_DEVICES names {}", names.len());
                return None;
            }
            for name in &names {
                assert!(listed.iter().any(|d| &d.name == name), "libibverbs lists no {name} (FAKE_IBVERBS_DEVICES?)");
            }
            return Some(Provider::Real(Arc::new(verbs), names));
        }
        let devices = (0..nics).map(|i| SimVerbs::device(&format!("sim{i}"), Some(0))).collect();
        Some(Provider::Sim(Arc::new(if nics == 1 { SimVerbs::new() } else { SimVerbs::with_devices(devices) })))
    }

    /// As [`Provider::try_with_nics`], for one NIC (always named).
    pub fn with_nics(nics: usize) -> Self {
        Self::try_with_nics(nics).expect("a NIC is named")
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

/// The fake libibverbs' late landings (`FAKE_IBVERBS_DELAY_FILE`,
/// tests/fakes/ibverbs/src/delay.rs): while its file exists, WRs posted
/// are placed and completed only later. The file is removed on drop, so a
/// failed test leaves no delay behind.
pub struct FakeDelay {
    file: std::path::PathBuf,
    kept: unsafe extern "C" fn() -> u64,
}

impl FakeDelay {
    /// WRs posted from now on land `ms` after their post (at a poll).
    pub fn delay_ms(&self, ms: u64) {
        std::fs::write(&self.file, ms.to_string()).unwrap();
    }

    /// WRs posted from now on land only once [`FakeDelay::release`] runs.
    pub fn hold(&self) {
        std::fs::write(&self.file, b"").unwrap();
    }

    /// Every kept WR is due at the next poll; later ones run at once.
    pub fn release(&self) {
        let _ = std::fs::remove_file(&self.file);
    }

    /// WRs the fake keeps now (posted, not yet placed).
    pub fn kept(&self) -> u64 {
        // SAFETY: the fake's `fake_ibverbs_delayed`, `extern "C" fn() -> u64`.
        unsafe { (self.kept)() }
    }
}

impl Drop for FakeDelay {
    fn drop(&mut self) {
        self.release();
    }
}

impl FakeDelay {
    /// The knob of the loaded fake, at `FAKE_IBVERBS_DELAY_FILE`; `None`,
    /// saying why, where the loaded libibverbs is not the fake (a host's
    /// NICs take no such knob) and nobody required the fake.
    pub fn find() -> Option<Self> {
        // SAFETY: dlopen of the loaded libibverbs by name, dlsym of the
        // fake's own introspection function, `extern "C" fn() -> u64`.
        let kept = unsafe {
            let lib = libc::dlopen(c"libibverbs.so.1".as_ptr(), libc::RTLD_NOW);
            let found =
                (!lib.is_null()).then(|| libc::dlsym(lib, c"fake_ibverbs_delayed".as_ptr())).filter(|p| !p.is_null());
            found.map(|p| std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn() -> u64>(p))
        };
        let Some(kept) = kept else {
            let why = "the loaded libibverbs is not the fake (no late landings on a host's NICs)";
            assert!(std::env::var_os("FAKE_IBVERBS_REQUIRED").is_none(), "{why}");
            eprintln!("skipped: {why}");
            return None;
        };
        let file = std::env::var_os("FAKE_IBVERBS_DELAY_FILE")
            .expect("FAKE_IBVERBS_DELAY_FILE unset: the fake's late landings need it (.ci/stage-fence-rdma.sh)");
        Some(FakeDelay { file: file.into(), kept })
    }
}

impl Provider {
    /// The fake's late landings, on the real provider over the fake (the
    /// stage sets `FAKE_IBVERBS_DELAY_FILE`); `None`, saying why, on the
    /// simulator (it places a WRITE's bytes when it is posted) and as
    /// [`FakeDelay::find`] says.
    pub fn fake_delay(&self) -> Option<FakeDelay> {
        let Provider::Real(..) = self else {
            eprintln!("skipped on the simulator: it places a WRITE's bytes when it is posted");
            return None;
        };
        FakeDelay::find()
    }
}

/// Two engines on the fake libibverbs' `fakeroce0` (a target and an
/// initiator, each with a 1 MiB region of its own), after the fake's
/// control-file variable `knob` is pointed at a fresh path in the temp dir
/// (the fake reads it at each call, so this runs before any verb). `None`,
/// saying why, where the fake is not loaded and nobody required it
/// (`FAKE_IBVERBS_REQUIRED`, what .ci/stage-fakeverbs.sh sets).
pub struct FakePair {
    /// The path `knob` names: the fault is on while it exists.
    pub switch: std::path::PathBuf,
    /// The target engine and its region.
    pub target: kvring::Engine,
    /// The target's region.
    pub remote: kvring::Region,
    /// The initiator engine.
    pub initiator: kvring::Engine,
    /// The initiator's region.
    pub local: kvring::Region,
}

/// See [`FakePair`]; `label` names the engines (`<label>-decode`, `-prefill`).
pub fn fake_pair(knob: &str, label: &str) -> Option<FakePair> {
    let switch = std::env::temp_dir().join(format!("kvring-{label}-{}", std::process::id()));
    std::env::set_var(knob, &switch);
    let listed = IbVerbs::new().devices().map(|d| d.iter().any(|d| d.name == "fakeroce0")).unwrap_or(false);
    if !listed {
        let why = "the fake libibverbs is not on LD_LIBRARY_PATH (run .ci/stage-fakeverbs.sh)";
        assert!(std::env::var_os("FAKE_IBVERBS_REQUIRED").is_none(), "{why}");
        eprintln!("skipped: {why}");
        return None;
    }
    let engine = |name: String| {
        super::builder(&name).rdma(Arc::new(IbVerbs::new())).rdma_devices(["fakeroce0"]).build().unwrap()
    };
    let target = engine(format!("{label}-decode"));
    let remote = target.alloc_region(1 << 20, kvring::RegionInfo::raw()).unwrap();
    let initiator = engine(format!("{label}-prefill"));
    let local = initiator.alloc_region(1 << 20, kvring::RegionInfo::raw()).unwrap();
    Some(FakePair { switch, target, remote, initiator, local })
}

/// Engines of one fence suite over rdma, on [`Provider::new`]'s provider:
/// a target with a 2 MiB region, an initiator with a 1 MiB one, and the
/// initiator's segment of the target, which must be rdma's. Both engines
/// named `<name>-target` and `<name>-initiator`, with `token` if given.
pub struct RdmaPair {
    /// The provider both engines share.
    pub provider: Provider,
    /// The target engine.
    pub target: kvring::Engine,
    /// The target's 2 MiB region.
    pub remote: kvring::Region,
    /// The initiator engine.
    pub initiator: kvring::Engine,
    /// The initiator's 1 MiB region.
    pub local: kvring::Region,
    /// The initiator's segment of the target, over rdma.
    pub segment: kvring::Segment,
}

/// See [`RdmaPair`].
pub fn rdma_pair(name: &str, token: Option<&str>) -> RdmaPair {
    let provider = Provider::new();
    let builder = |role: &str| {
        let builder = provider.apply(super::builder(&format!("{name}-{role}")));
        match token {
            Some(token) => builder.token(token),
            None => builder,
        }
    };
    let target = builder("target").build().unwrap();
    let remote = target.alloc_region(2 << 20, kvring::RegionInfo::raw()).unwrap();
    let initiator = builder("initiator").build().unwrap();
    let local = initiator.alloc_region(1 << 20, kvring::RegionInfo::raw()).unwrap();
    let addr = target.control_addr().to_string();
    let segment = initiator.open_segment_with(&addr, Some(kvring::TransportKind::Rdma), super::WAIT).unwrap();
    assert_eq!(segment.transport(), kvring::TransportKind::Rdma);
    RdmaPair { provider, target, remote, initiator, local, segment }
}

/// What a test asks of the fabric beyond the verbs (a fault on demand, the
/// bytes each NIC moved, a registration's rights): the simulator's own
/// methods, or the fake libibverbs' `fake_ibverbs_*` symbols
/// (tests/fakes/ibverbs/src/control.rs), which kvring never calls.
pub enum Referee {
    /// The simulator, with its NICs' names.
    Sim(Arc<SimVerbs>, Vec<String>),
    /// The fake libibverbs' control symbols, with the NICs' names.
    Fake(FakeControl, Vec<String>),
}

/// The fake libibverbs' control symbols, found with `dlsym`.
pub struct FakeControl {
    fail_next: FailNext,
    bytes_moved: BytesMoved,
    mr_access: MrAccessFlags,
    mr_paths: MrPaths,
    cq_overruns: CqOverruns,
    device_fatal: DeviceFatal,
}

// The signatures tests/fakes/ibverbs/src/control.rs exports them with.
type FailNext = unsafe extern "C" fn(u64, u32) -> i32;
type BytesMoved = unsafe extern "C" fn(*const std::ffi::c_char, u64) -> u64;
type MrAccessFlags = unsafe extern "C" fn(u64) -> i64;
type MrPaths = unsafe extern "C" fn(u64, *mut u32, usize) -> usize;
type CqOverruns = unsafe extern "C" fn() -> u64;
type DeviceFatal = unsafe extern "C" fn(*const std::ffi::c_char) -> i32;

impl FakeControl {
    /// The loaded fake's symbols; `None`, saying why, where the loaded
    /// libibverbs is not the fake (a host's NICs take no such knob) and
    /// nobody required the fake (`FAKE_IBVERBS_REQUIRED`).
    pub fn find() -> Option<Self> {
        use std::mem::transmute;
        // SAFETY: dlopen of the loaded libibverbs by name; dlsym of the
        // fake's own functions, each transmuted to the signature
        // tests/fakes/ibverbs/src/control.rs exports it with.
        let found = unsafe {
            let lib = libc::dlopen(c"libibverbs.so.1".as_ptr(), libc::RTLD_NOW);
            let sym = |name: &std::ffi::CStr| {
                let p = if lib.is_null() { std::ptr::null_mut() } else { libc::dlsym(lib, name.as_ptr()) };
                (!p.is_null()).then_some(p)
            };
            (|| {
                Some(FakeControl {
                    fail_next: transmute::<*mut libc::c_void, FailNext>(sym(c"fake_ibverbs_fail_next")?),
                    bytes_moved: transmute::<*mut libc::c_void, BytesMoved>(sym(c"fake_ibverbs_bytes_moved")?),
                    mr_access: transmute::<*mut libc::c_void, MrAccessFlags>(sym(c"fake_ibverbs_mr_access")?),
                    mr_paths: transmute::<*mut libc::c_void, MrPaths>(sym(c"fake_ibverbs_mr_paths")?),
                    cq_overruns: transmute::<*mut libc::c_void, CqOverruns>(sym(c"fake_ibverbs_cq_overruns")?),
                    device_fatal: transmute::<*mut libc::c_void, DeviceFatal>(sym(c"fake_ibverbs_device_fatal")?),
                })
            })()
        };
        if found.is_none() {
            let why = "the loaded libibverbs is not the fake (a host's NICs take no test knob)";
            assert!(std::env::var_os("FAKE_IBVERBS_REQUIRED").is_none(), "{why}");
            eprintln!("skipped: {why}");
        }
        found
    }
}

/// ibv_wc_status's value for `status` (verbs.h `enum ibv_wc_status`).
fn wc_code(status: WcStatus) -> u32 {
    match status {
        WcStatus::Success => 0,
        WcStatus::LocalProtection => 4,
        WcStatus::Flushed => 5,
        WcStatus::RemoteAccess => 10,
        WcStatus::RetryExceeded => 12,
        WcStatus::Other(code) => code,
    }
}

impl Referee {
    /// The NICs' names, in order (`sim0`..., or the fake's).
    pub fn nics(&self) -> &[String] {
        match self {
            Referee::Sim(_, nics) | Referee::Fake(_, nics) => nics,
        }
    }

    /// The next request towards the peer memory at `remote_addr` fails
    /// with `status` (the simulator's `fail_next` takes the next request
    /// of its fabric, which is the test's own).
    pub fn fail_next(&self, remote_addr: u64, status: WcStatus) {
        match self {
            Referee::Sim(sim, _) => sim.fail_next(status),
            // SAFETY: the fake's `fake_ibverbs_fail_next(u64, u32) -> i32`.
            Referee::Fake(fake, _) => assert_eq!(unsafe { (fake.fail_next)(remote_addr, wc_code(status)) }, 0),
        }
    }

    /// Bytes that requests posted through NIC `nic` (an index into
    /// [`Referee::nics`]) moved to or from the peer memory registered at
    /// `remote_addr` (the simulator counts the NIC's every request: the
    /// test's fabric is its own).
    pub fn bytes_moved(&self, nic: usize, remote_addr: u64) -> u64 {
        match self {
            Referee::Sim(sim, nics) => sim.bytes_moved(&nics[nic]),
            Referee::Fake(fake, nics) => {
                let name = std::ffi::CString::new(nics[nic].as_str()).unwrap();
                // SAFETY: the fake's `fake_ibverbs_bytes_moved`, given a
                // NUL-terminated name.
                unsafe { (fake.bytes_moved)(name.as_ptr(), remote_addr) }
            }
        }
    }

    /// The rights the registration at `addr` was made with, as the NIC
    /// enforces them.
    pub fn mr_rights(&self, addr: u64) -> Option<kvring::rdma::MrAccess> {
        match self {
            Referee::Sim(sim, _) => sim.mr_rights(addr),
            Referee::Fake(fake, _) => {
                // SAFETY: the fake's `fake_ibverbs_mr_access(u64) -> i64`.
                let flags = unsafe { (fake.mr_access)(addr) };
                // verbs.h `enum ibv_access_flags`.
                (flags >= 0).then_some(kvring::rdma::MrAccess {
                    local_write: flags & 1 != 0,
                    remote_write: flags & (1 << 1) != 0,
                    remote_read: flags & (1 << 2) != 0,
                    relaxed_ordering: flags & (1 << 20) != 0,
                })
            }
        }
    }
}

impl Referee {
    /// How each live registration at `addr` (one per NIC that registered
    /// it) reaches its memory.
    pub fn mr_paths(&self, addr: u64) -> Vec<kvring::rdma::MrPath> {
        use kvring::rdma::MrPath;
        match self {
            Referee::Sim(sim, _) => sim.mr_paths(addr),
            Referee::Fake(fake, _) => {
                let mut paths = [0u32; 16];
                // SAFETY: the fake's `fake_ibverbs_mr_paths`, given room for 16.
                let n = unsafe { (fake.mr_paths)(addr, paths.as_mut_ptr(), paths.len()) };
                assert!(n <= paths.len(), "{n} registrations at {addr:#x}");
                // tests/fakes/ibverbs/src/control.rs `MrPath`.
                paths[..n]
                    .iter()
                    .map(|&path| match path {
                        0 => MrPath::Host,
                        1 => MrPath::DmaBuf,
                        2 => MrPath::PeerMemory,
                        other => panic!("the fake names no path {other}"),
                    })
                    .collect()
            }
        }
    }
}

impl Referee {
    /// CQs overrun (fatal to a real CQ): on the fake, by any test of this
    /// process, each of which expects none.
    pub fn cq_overruns(&self) -> u64 {
        match self {
            Referee::Sim(sim, _) => sim.cq_overruns(),
            // SAFETY: the fake's `fake_ibverbs_cq_overruns() -> u64`.
            Referee::Fake(fake, _) => unsafe { (fake.cq_overruns)() },
        }
    }
}

impl Provider {
    /// The referee of this provider's fabric: the simulator, or the fake
    /// libibverbs' control symbols; `None`, saying why, on a host's own NICs.
    pub fn referee(&self) -> Option<Referee> {
        match self {
            Provider::Sim(sim) => {
                let nics = sim.devices().unwrap().into_iter().map(|d| d.name).collect();
                Some(Referee::Sim(sim.clone(), nics))
            }
            Provider::Real(_, names) => FakeControl::find().map(|fake| Referee::Fake(fake, names.clone())),
        }
    }
}

/// Runs test `name` of this test binary alone in a child process with
/// `env` set (ignored tests too) and asserts it passed: for a fake's knob
/// that holds for the whole process, which every other test would see.
pub fn run_child(name: &str, env: &[(&str, &str)]) {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap());
    child.args([name, "--exact", "--nocapture", "--test-threads=1", "--include-ignored"]);
    for (key, value) in env {
        child.env(key, value);
    }
    let out = child.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{name} in a child: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Referee {
    /// NIC `nic` disappears (hot-unplug, driver reset): the simulator
    /// removes it; the fake fails it for this process
    /// (`fake_ibverbs_device_fatal`: IBV_EVENT_DEVICE_FATAL, then EIO).
    /// What the errors that follow say: the work in flight's (kvring reads
    /// the fake's async event), then a new link's (the verbs' EIO).
    pub fn remove_device(&self, nic: usize) -> (&'static str, &'static str) {
        match self {
            Referee::Sim(sim, nics) => {
                sim.remove_device(&nics[nic]);
                ("no longer present", "no longer present")
            }
            Referee::Fake(fake, nics) => {
                let name = std::ffi::CString::new(nics[nic].as_str()).unwrap();
                // SAFETY: the fake's `fake_ibverbs_device_fatal`, given a
                // NUL-terminated name.
                assert_eq!(unsafe { (fake.device_fatal)(name.as_ptr()) }, 0);
                // The reopen's verb fails with a bare EIO; the error says
                // what the NIC reported before it.
                ("failed (IBV_EVENT_DEVICE_FATAL)", "failed (IBV_EVENT_DEVICE_FATAL)")
            }
        }
    }
}
