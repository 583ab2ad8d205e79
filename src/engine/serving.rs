//! Wiring the target's tcp data connections to the lanes that serve them:
//! each lane gets its share (`transport::tcp::Served`), and the acceptor a
//! [`Dispatch`] that hands a new connection to the least loaded lane.

use crate::auth::Authenticator;
use crate::error::Result;
use crate::mem::Registry;
use crate::net::{Admission, AdmissionLimits};
use crate::notify::NotificationQueue;
use crate::runtime::lane::{LaneCommand, LaneHandle, LaneShared};
use crate::transport::tcp::server::Dispatch;
use crate::transport::tcp::{Served, TargetContext, TcpDataServer};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The lanes as the acceptor sees them: where to send a connection, and
/// how many each serves.
#[derive(Debug)]
struct LaneDispatch {
    lanes: Vec<(Arc<LaneShared>, Arc<AtomicUsize>)>,
}

impl Dispatch for LaneDispatch {
    fn lanes(&self) -> usize {
        self.lanes.len()
    }

    fn load(&self, lane: usize) -> usize {
        self.lanes.get(lane).map_or(usize::MAX, |(_, load)| load.load(Ordering::Relaxed))
    }

    fn adopt(&self, lane: usize, stream: TcpStream, id: u64) {
        if let Some((shared, _)) = self.lanes.get(lane) {
            shared.send(LaneCommand::Adopt { stream, id });
        }
    }

    fn evict(&self, lane: usize, id: u64, too_late: bool) {
        if let Some((shared, _)) = self.lanes.get(lane) {
            shared.send(LaneCommand::Evict { id, too_late });
        }
    }
}

/// What the target's data connections are checked against.
pub(super) struct Target {
    pub registry: Arc<Registry>,
    pub notifications: Arc<NotificationQueue>,
    pub arrivals: Arc<crate::arrival::Arrivals>,
    pub epoch: u64,
    pub auth: Option<Arc<Authenticator>>,
}

/// Starts the tcp data listener on `listen`, its connections served by
/// `lanes` within `limits`.
pub(super) fn serve_tcp(
    listen: SocketAddr,
    lanes: &[LaneHandle],
    target: Target,
    limits: AdmissionLimits,
) -> Result<TcpDataServer> {
    let Target { registry, notifications, arrivals, epoch, auth } = target;
    let ctx = Arc::new(TargetContext { registry, notifications, arrivals, epoch, auth });
    let admission = Arc::new(Mutex::new(Admission::new(limits)));
    let mut dispatch = LaneDispatch { lanes: Vec::with_capacity(lanes.len()) };
    for lane in lanes {
        let load = Arc::new(AtomicUsize::new(0));
        let metrics = &lane.shared.metrics;
        let served = Served::new(ctx.clone(), admission.clone(), load.clone(), metrics.gpu_copies(), metrics.staging());
        lane.shared.send(LaneCommand::Serve(Box::new(served)));
        dispatch.lanes.push((lane.shared.clone(), load));
    }
    TcpDataServer::start(listen, admission, Arc::new(dispatch), epoch)
}
