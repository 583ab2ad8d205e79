//! Push a block to a running `kvring serve` and read it back.
//! Run: cargo run --release --example quickstart -- 127.0.0.1:PORT
use kvring::{Batch, BlockDesc, Engine, Outcome, RegionInfo};
use std::time::Duration;

fn main() -> kvring::Result<()> {
    let peer = std::env::args().nth(1).expect("usage: quickstart PEER (kvring serve prints listen=ADDR)");
    let engine = Engine::builder().name("quickstart").build()?;
    // Shared memory, pre-faulted: DMA memory that batches and peers write.
    let kv = engine.alloc_region(1 << 20, RegionInfo::raw())?;
    // SAFETY: no batch moves these bytes yet.
    unsafe { kv.write_at(0, &[42u8; 4096])? };
    let decode = engine.open_segment(&peer)?; // handshake, then cached
    let mut sub = engine.submitter()?; // one per thread
    let push = [BlockDesc::new(kv.id(), 0, decode.region(0)?, 0, 4096)];
    let pull = [BlockDesc::new(kv.id(), 8192, decode.region(0)?, 0, 4096)];
    for batch in [Batch::write(&decode).descs(&push), Batch::read(&decode).descs(&pull)] {
        let id = sub.submit(&batch.deadline(Duration::from_secs(1)))?;
        match sub.wait(id, Duration::from_secs(2))? {
            Outcome::Done { bytes } => println!("{bytes} bytes moved over {}", decode.transport().name()),
            other => panic!("the batch ended {other:?}"),
        }
    }
    let mut back = [0u8; 4096];
    // SAFETY: both batches have ended; nothing else moves these bytes.
    unsafe { kv.read_at(8192, &mut back)? };
    assert_eq!(back, [42u8; 4096], "what came back is what went out");
    Ok(())
}
