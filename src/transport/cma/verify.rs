//! cma's side of end-to-end checksums: the peer's landed bytes read back
//! with `process_vm_readv`, through the same checks as every call
//! (`move_all`: the target proven live, every region still listed), into
//! a bounce buffer of the lane's own, and checksummed there.

use super::sys::IoVec;
use super::CmaLink;
use crate::error::{Error, Result};
use crate::ring::Opcode;
use crate::transport::checksum::Crc32c;
use crate::transport::Block;
use std::cell::RefCell;

/// Bytes read back per call: the bounce buffer each lane thread keeps.
const BOUNCE_BYTES: usize = 1 << 20;

thread_local! {
    /// Grown once per lane thread to [`BOUNCE_BYTES`], then reused.
    static BOUNCE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

impl CmaLink {
    /// Points the gathered remote range of `block` (checked for `op`'s
    /// rights, as the copy was) at `local`, `len` bytes from `skip`, then
    /// reads it there.
    fn read_back(&mut self, op: Opcode, block: &Block, skip: usize, local: &mut [u8]) -> Result<()> {
        if let Some(error) = self.gather(op, std::slice::from_ref(block), None) {
            return Err(error);
        }
        let remote = self.remote[0];
        self.remote[0] = IoVec { base: remote.base + skip, len: local.len() };
        self.local[0] = IoVec { base: local.as_mut_ptr() as usize, len: local.len() };
        self.move_all(Opcode::Read).map(|_| ()).map_err(|(error, _)| error)
    }

    /// Continues `sum` over the peer's bytes under `block`'s remote range.
    pub(super) fn read_crc32c(&mut self, op: Opcode, block: &Block, sum: &mut Crc32c) -> Result<()> {
        let len = block.desc.len as usize;
        BOUNCE.with(|bounce| {
            let mut bounce = bounce.try_borrow_mut().map_err(|_| Error::invalid("cma read-back", "re-entered"))?;
            bounce.resize(BOUNCE_BYTES.min(len.max(1)), 0);
            let mut done = 0usize;
            while done < len {
                let n = (len - done).min(bounce.len());
                self.read_back(op, block, done, &mut bounce[..n])?;
                sum.update(&bounce[..n]);
                done += n;
            }
            Ok(())
        })
    }

    /// Flips the first landed byte of `block` (the `testing` feature's
    /// corruption hook): read, flipped, written back.
    pub(super) fn flip_remote(&mut self, block: &Block) {
        let mut byte = [0u8; 1];
        if block.desc.len == 0 || self.read_back(Opcode::Write, block, 0, &mut byte).is_err() {
            return;
        }
        byte[0] ^= 0x5a;
        if self.gather(Opcode::Write, std::slice::from_ref(block), None).is_none() {
            self.remote[0].len = 1;
            self.local[0] = IoVec { base: byte.as_mut_ptr() as usize, len: 1 };
            let _ = self.move_all(Opcode::Write);
        }
    }
}
