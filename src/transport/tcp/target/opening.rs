//! A target connection's opening: the client's hello (this start's epoch),
//! the session proof when a token is set, and the admission policy's last
//! word, before any byte is read as a frame.

use super::super::hello::{
    ClientHello, ClientProof, ServerHello, CLIENT_HELLO_BYTES, CLIENT_PROOF_BYTES, FLAG_PROOF_REQUIRED,
};
use super::{Admit, Phase, TargetConn, TargetContext};
use crate::auth::{random_bytes, Nonce};
use crate::error::Error;
use zerocopy::IntoBytes;

impl TargetConn {
    pub(super) fn refuse(&mut self, error: &Error, epoch: u64) {
        self.queue(ServerHello::refusal(error, epoch).as_bytes());
        self.phase = Phase::Closing;
    }

    pub(super) fn on_hello(&mut self, ctx: &TargetContext, admit: Admit<'_>) -> bool {
        let Some(bytes) = self.take(CLIENT_HELLO_BYTES) else { return false };
        let hello = match ClientHello::decode(bytes) {
            Ok(hello) => hello,
            Err(error) => {
                self.refuse(&error, ctx.epoch);
                return true;
            }
        };
        if hello.epoch != ctx.epoch {
            let error = Error::PeerRestarted {
                segment: "this target".into(),
                detail: format!("a connection for epoch {:#x}, but this start is {:#x}", hello.epoch, ctx.epoch),
            };
            self.refuse(&error, ctx.epoch);
            return true;
        }
        match &ctx.auth {
            Some(_) => {
                let nonce: Nonce = random_bytes();
                self.queue(ServerHello::new(0, FLAG_PROOF_REQUIRED, ctx.epoch, nonce).as_bytes());
                self.phase = Phase::Proof { nonce, cn: hello.client_nonce, sn: hello.server_nonce };
            }
            None => self.admitted(ctx, admit),
        }
        true
    }

    pub(super) fn on_proof(
        &mut self,
        ctx: &TargetContext,
        admit: Admit<'_>,
        nonce: Nonce,
        cn: Nonce,
        sn: Nonce,
    ) -> bool {
        let Some(bytes) = self.take(CLIENT_PROOF_BYTES) else { return false };
        let proven = ClientProof::decode(bytes)
            .ok()
            .zip(ctx.auth.as_ref())
            .is_some_and(|(proof, auth)| auth.check_data(&cn, &sn, &nonce, &proof.mac));
        if proven {
            // Its staging pages count against its proven session (one
            // initiator's handshake), whatever number of connections it opens.
            self.set_stage_identity(session_identity(&cn, &sn));
            self.admitted(ctx, admit);
        } else {
            let error = Error::Unauthorized { reason: "no valid session proof".into() };
            self.refuse(&error, ctx.epoch);
        }
        true
    }

    /// The connection proved itself: the admission policy has the last word.
    fn admitted(&mut self, ctx: &TargetContext, admit: Admit<'_>) {
        match admit() {
            Ok(()) => {
                self.queue(ServerHello::new(0, 0, ctx.epoch, [0; 16]).as_bytes());
                self.phase = Phase::Serving;
            }
            Err(bound) => self.refuse(&Error::Busy { queue: bound, capacity: 0 }, ctx.epoch),
        }
    }
}

/// A proven session's identity for staging quotas: its nonces folded to 62
/// bits (the top bits mark connection-only identities and are left clear).
fn session_identity(cn: &Nonce, sn: &Nonce) -> u64 {
    let fold = |n: &Nonce| u64::from_le_bytes(n[..8].try_into().expect("8 bytes"));
    (fold(cn) ^ fold(sn).rotate_left(17)) >> 2
}
