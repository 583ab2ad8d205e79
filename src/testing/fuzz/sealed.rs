//! Fuzz entry points for what a tokened session seals: control messages
//! after the handshake, the step-2 answer, and data frame headers past a
//! real session proof. Each input byte string is tried twice: as it is (it
//! must never open: the fuzzer does not hold the session key), and sealed
//! by the harness, which holds it (so the decoders behind the seal are
//! reached too).

use super::{guards_intact, served, Served, Wire, GUARD_BYTES, SERVED_BYTES};
use crate::auth::{Initiator, Nonce, Seen, Session, Token};
use crate::control::client::open_step_two;
use crate::control::frame::{decode_request, read_frame};
use crate::seal::{check_listener_proof, descriptor_seal, ControlSeal, End, FrameSeal};
use crate::transport::tcp::frame::{FrameHeader, FrameOp, FRAME_HEADER_BYTES};
use crate::transport::tcp::hello::{ClientHello, ClientProof, ServerHello, SERVER_HELLO_BYTES};
use crate::transport::tcp::target::TargetConn;
use std::io::Write;
use std::time::{Duration, Instant};
use zerocopy::{FromBytes, IntoBytes};

const TOKEN: &str = "fuzz-token";

fn session() -> Session {
    Token::new(TOKEN).session([1; 16], [2; 16], 42)
}

/// Control messages after a tokened handshake, and the step-2 answer: raw
/// bytes never open; sealed ones open in order and reach the decoders.
pub fn sealed_control(data: &[u8]) {
    let session = session();
    // Each framed message, as it came: never opens (no key), and a failed
    // one never advances the numbering.
    let mut target = ControlSeal::new(&session, End::Target);
    let mut reader = data;
    while let Ok(Some(body)) = read_frame(&mut reader, 1 << 16) {
        assert!(target.open(&body).is_err(), "a message opened without the session key");
    }
    // The same bodies sealed by a holder of the key: open, in order.
    let mut initiator = ControlSeal::new(&session, End::Initiator);
    let mut reader = data;
    while let Ok(Some(mut body)) = read_frame(&mut reader, 1 << 16) {
        let plain = body.clone();
        initiator.seal(&mut body);
        let opened = target.open(&body).expect("a sealed message opens");
        assert_eq!(opened, plain.as_slice());
        let _ = decode_request(opened);
    }
    // The bytes as a step-2 answer: never taken as it is; taken only with
    // the session's seal over the transcript.
    let proof = Token::new(TOKEN).client_proof(&[1; 16], &[2; 16], 42, &initiator_of(), &seen_of());
    if let Ok(mut reply) = <crate::proto::HandshakeResponse as prost::Message>::decode(data) {
        assert!(open_step_two(&session, &proof, &reply, 42, "fuzz").is_err(), "an unsealed descriptor was taken");
        reply.segment = None;
        reply.seal = descriptor_seal(&session, &proof, &reply.sealed_segment).to_vec();
        if let Ok(descriptor) = open_step_two(&session, &proof, &reply, 42, "fuzz") {
            assert_eq!(descriptor.epoch, 42);
        }
    }
    let mut raw = crate::proto::HandshakeResponse { sealed_segment: data.to_vec(), ..Default::default() };
    raw.seal = descriptor_seal(&session, &proof, data).to_vec();
    let _ = open_step_two(&session, &proof, &raw, 42, "fuzz");
}

fn initiator_of() -> Initiator {
    Initiator { name: "fuzz".into(), epoch: 7, addr: String::new() }
}

fn seen_of() -> Seen {
    Seen { dialed: "127.0.0.1:7000".into(), local: "127.0.0.1:40000".into() }
}

/// A socket stand-in that keeps what the target writes.
struct Recorder<'a> {
    wire: Wire<'a>,
    out: Vec<u8>,
}

impl std::io::Read for Recorder<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.wire.read(buf)
    }
}

impl Write for Recorder<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.wire.write(buf)?;
        self.out.extend_from_slice(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Drives `conn` with `input` until it has nothing more to do; returns what
/// it wrote.
fn exchange(conn: &mut TargetConn, served: &Served, input: &[u8], piece: usize) -> Vec<u8> {
    let now = Instant::now();
    let mut io = Recorder { wire: Wire { input, piece, written: 0 }, out: Vec::new() };
    let mut admit = || Ok(());
    for _ in 0..input.len() + 8 {
        let read = conn.on_readable(&mut io, &served.ctx, &mut admit, now, &mut Default::default());
        let written = conn.on_writable(&mut io, &served.ctx, &mut Default::default());
        if read.is_err() || written.is_err() || conn.finished() || (io.wire.input.is_empty() && !conn.wants_write()) {
            break;
        }
    }
    io.out
}

/// Opens a data connection to a tokened target as a holder of the token
/// would: the listener's proof checks, ours is accepted. Returns the
/// connection and the initiator's frame seal.
fn opened(served: &Served) -> (TargetConn, FrameSeal) {
    let auth = served.ctx.auth.as_ref().expect("a tokened target");
    let cn: Nonce = [1; 16];
    let (sn, _) = auth.challenge(&cn);
    let session = Token::new(TOKEN).session(cn, sn, 42);
    let mut conn = TargetConn::new(Instant::now(), Duration::from_secs(2));
    let nonce = [3; 16];
    let out = exchange(&mut conn, served, ClientHello::new(42, cn, sn, nonce).as_bytes(), 64);
    let answer = ServerHello::read_from_bytes(&out[..SERVER_HELLO_BYTES]).expect("a server hello");
    assert!(check_listener_proof(&session, &nonce, &answer.nonce, 42, &answer.proof), "the listener proves nothing");
    let proof = ClientProof::new(session.data_proof(&answer.nonce, 42));
    let verdict = exchange(&mut conn, served, proof.as_bytes(), 64);
    assert_eq!(ServerHello::read_from_bytes(&verdict[..SERVER_HELLO_BYTES]).map(|h| h.status), Ok(0));
    (conn, FrameSeal::new(&session, &nonce, &answer.nonce, 42, End::Initiator))
}

/// Frames past a real session proof. As they come (no valid MAC), nothing
/// is served; sealed by the harness (each header of the input numbered and
/// signed, payloads as the input says), they are served within the region
/// only, and every reply the target sends checks under the session, in
/// order.
pub fn sealed_frames(data: &[u8]) {
    let piece = data.first().map_or(1, |b| usize::from(*b % 61) + 1);
    let body = data.get(1..).unwrap_or_default();
    let served = served(Some(TOKEN));
    let (mut conn, _) = opened(&served);
    let _ = exchange(&mut conn, &served, body, piece);
    conn.release(&served.ctx, &mut Default::default());
    assert!(served.memory[GUARD_BYTES..GUARD_BYTES + SERVED_BYTES].iter().all(|&b| b == 0), "an unsealed frame landed");
    assert!(served.ctx.notifications.poll().is_none(), "an unsealed notification got in");
    guards_intact(&served);

    let served = served_again();
    let (mut conn, mut seal) = opened(&served);
    let (sealed, _) = seal_input(body, &mut seal);
    let out = exchange(&mut conn, &served, &sealed, piece);
    conn.release(&served.ctx, &mut Default::default());
    check_replies(&out, &mut seal);
    guards_intact(&served);
}

fn served_again() -> Served {
    served(Some(TOKEN))
}

/// The input as frames: each header's fields from the input (its
/// number replaced by the next), signed; then the payload its opcode and
/// length call for, as far as the input goes.
fn seal_input(mut body: &[u8], seal: &mut FrameSeal) -> (Vec<u8>, usize) {
    let mut out = Vec::with_capacity(body.len() + FRAME_HEADER_BYTES);
    let mut frames = 0;
    while body.len() >= FRAME_HEADER_BYTES {
        let Ok(mut header) = FrameHeader::read_from_bytes(&body[..FRAME_HEADER_BYTES]) else { break };
        body = &body[FRAME_HEADER_BYTES..];
        header.seal(seal);
        out.extend_from_slice(header.as_bytes());
        let carries = header.opcode == FrameOp::Write as u8 || header.opcode == FrameOp::Notify as u8;
        let len = if carries { (header.len as usize).min(body.len()) } else { 0 };
        out.extend_from_slice(&body[..len]);
        body = &body[len..];
        frames += 1;
    }
    (out, frames)
}

/// Every reply header the target wrote checks under the session, in order.
fn check_replies(mut out: &[u8], seal: &mut FrameSeal) {
    let mut receiver = seal.clone();
    // The initiator's seal checks the target's direction.
    while out.len() >= FRAME_HEADER_BYTES {
        let header = FrameHeader::read_from_bytes(&out[..FRAME_HEADER_BYTES]).expect("72 bytes");
        header.check_seal(&mut receiver).expect("every reply is sealed, in order");
        out = &out[FRAME_HEADER_BYTES..];
        // A READ_DATA that is not a failure carries its payload (its
        // status is 0, or its CRC32C with FLAG_CHECKSUM).
        if header.opcode == FrameOp::ReadData as u8 && header.failure().is_none() {
            out = &out[(header.len as usize).min(out.len())..];
        }
    }
}

#[cfg(test)]
mod tests {
    /// The committed seeds of every target of the wire this session
    /// changed, and each cut and flipped, hold every property (what CI's
    /// bounded fuzz run starts from).
    #[test]
    fn seeds_and_their_mutants_hold() {
        use crate::testing::fuzz;
        for (target, entry) in [
            ("sealed_control", super::sealed_control as fn(&[u8])),
            ("sealed_frames", super::sealed_frames as fn(&[u8])),
            ("data_hello", fuzz::data_hello as fn(&[u8])),
            ("target_connection", fuzz::target_connection as fn(&[u8])),
            ("frame_header", fuzz::frame_header as fn(&[u8])),
            ("control_requests", fuzz::control_requests as fn(&[u8])),
            ("control_message", fuzz::control_message as fn(&[u8])),
            ("initiator_replies", fuzz::initiator_replies as fn(&[u8])),
        ] {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds").join(target);
            let mut seen = 0;
            for file in std::fs::read_dir(&dir).expect("seeds are committed") {
                let seed = std::fs::read(file.unwrap().path()).unwrap();
                entry(&seed);
                for cut in [1, seed.len() / 2, seed.len().saturating_sub(1)] {
                    entry(&seed[..cut.min(seed.len())]);
                }
                let mut flipped = seed.clone();
                for index in (0..flipped.len()).step_by(7) {
                    flipped[index] ^= 0x5a;
                }
                entry(&flipped);
                seen += 1;
            }
            assert!(seen > 0, "no seeds for {target}");
        }
    }
}
