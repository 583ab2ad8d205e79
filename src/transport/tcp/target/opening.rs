//! A target connection's opening: the client's hello (this start's epoch),
//! the session proof when a token is set, and the admission policy's last
//! word, before any byte is read as a frame.

use super::super::hello::{
    ClientHello, ClientProof, ServerHello, CLIENT_HELLO_BYTES, CLIENT_PROOF_BYTES, FLAG_PROOF_REQUIRED,
};
use super::{Admit, Phase, TargetConn, TargetContext};
use crate::auth::{random_bytes, Nonce};
use crate::error::Error;
use crate::seal::{listener_proof, End, FrameSeal};
use zerocopy::IntoBytes;

impl TargetConn {
    pub(super) fn refuse(&mut self, error: &Error, epoch: u64) {
        self.queue(ServerHello::refusal(error, epoch).as_bytes());
        self.phase = Phase::Closing;
    }

    pub(super) fn on_hello(&mut self, ctx: &TargetContext, admit: Admit<'_>) -> bool {
        // A stranger, or a peer of another version (whose hello may be
        // shorter), is told so now rather than waited on.
        if let Some(error) = ClientHello::early_refusal(&self.buffer[self.start..self.end]) {
            self.start = self.end;
            self.refuse(&error, ctx.epoch);
            return true;
        }
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
            Some(auth) => {
                // The listener proves the session first, so a tokened
                // initiator can tell this engine from a relay's tap.
                let (cn, sn) = (hello.client_nonce, hello.server_nonce);
                let Some(session) = auth.session_for(&cn, &sn) else {
                    let error = Error::Unauthorized { reason: "no session this start issued".into() };
                    self.refuse(&error, ctx.epoch);
                    return true;
                };
                let nonce: Nonce = random_bytes();
                let mut answer = ServerHello::new(0, FLAG_PROOF_REQUIRED, ctx.epoch, nonce);
                answer.proof = listener_proof(&session, &hello.nonce, &nonce, ctx.epoch);
                self.queue(answer.as_bytes());
                self.phase = Phase::Proof { nonce, client: hello.nonce, cn, sn };
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
        client: Nonce,
        (cn, sn): (Nonce, Nonce),
    ) -> bool {
        let Some(bytes) = self.take(CLIENT_PROOF_BYTES) else { return false };
        let proven = ClientProof::decode(bytes)
            .ok()
            .zip(ctx.auth.as_ref())
            .is_some_and(|(proof, auth)| auth.check_data(&cn, &sn, &nonce, &proof.mac));
        let session = ctx.auth.as_ref().and_then(|auth| auth.session_for(&cn, &sn));
        if let (true, Some(session)) = (proven, session) {
            self.seal = Some(FrameSeal::new(&session, &client, &nonce, ctx.epoch, End::Target));
            // Its staging pages count against its proven session (one
            // initiator's handshake), whatever number of connections it opens.
            self.set_stage_identity(session_identity(&cn, &sn));
            // Its tagged writes count as the initiator its handshake proved.
            self.sender = ctx.auth.as_ref().and_then(|auth| auth.sender_of(&cn, &sn));
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
