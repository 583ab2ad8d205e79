//! Control-plane framing: a 4-byte little-endian length, then one protobuf
//! message. Decoders here take bytes from outside; each has a fuzz target.

use crate::error::{Error, Result};
use crate::proto::{request, response, Request, Response};
use prost::Message;
use std::io::{Read, Write};

/// The control-plane version this engine speaks.
///
/// Version 3 binds the tokened handshake to the connection and the
/// descriptor, and seals every later message (`seal.rs`). Version 4
/// widens region ids to 64 bits (a 32-bit generation): a version 3 peer's
/// 32-bit ids would be misread, so it is refused by version instead.
pub const CONTROL_VERSION: u32 = 4;
/// Largest control message accepted, bytes.
pub const MAX_CONTROL_MESSAGE_BYTES: u32 = 4 << 20;
/// What a control connection opens with, each way: `KVRC` and the version.
pub const PREFACE_MAGIC: [u8; 4] = *b"KVRC";
/// Bytes of the preface.
pub const PREFACE_BYTES: usize = 8;

/// The preface this engine sends.
pub fn preface() -> [u8; PREFACE_BYTES] {
    let mut bytes = [0u8; PREFACE_BYTES];
    bytes[..4].copy_from_slice(&PREFACE_MAGIC);
    bytes[4..].copy_from_slice(&CONTROL_VERSION.to_le_bytes());
    bytes
}

/// Checks a peer's preface: `what` names the other end for the error
/// ("10.0.0.2:7000", "a client").
pub fn check_preface(bytes: &[u8], what: &str) -> Result<()> {
    if bytes.len() < PREFACE_BYTES || bytes[..4] != PREFACE_MAGIC {
        return Err(Error::not_kvring(what, bytes));
    }
    let version = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
    if version != CONTROL_VERSION {
        return Err(Error::VersionMismatch { got: version, supported: CONTROL_VERSION });
    }
    Ok(())
}

/// Writes one length-prefixed message.
pub fn write_frame(writer: &mut impl Write, message: &impl Message) -> Result<()> {
    write_sealed(writer, message, None)
}

/// Writes one length-prefixed message, followed by its session MAC when
/// the connection is sealed.
pub(crate) fn write_sealed(
    writer: &mut impl Write,
    message: &impl Message,
    seal: Option<&mut crate::seal::ControlSeal>,
) -> Result<()> {
    let mut body = message.encode_to_vec();
    if let Some(seal) = seal {
        seal.seal(&mut body);
    }
    let len = u32::try_from(body.len())
        .map_err(|_| Error::MessageTooLarge { len: body.len() as u64, max: MAX_CONTROL_MESSAGE_BYTES.into() })?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    writer.write_all(&frame).map_err(|e| Error::io("writing control message", e))
}

/// Reads one length-prefixed message body; refuses lengths over `max`.
/// `Ok(None)` on a clean end of stream before the length.
pub fn read_frame(reader: &mut impl Read, max: u32) -> Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match reader.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(Error::io("reading control message length", e)),
    }
    let len = u32::from_le_bytes(len);
    if len > max {
        return Err(Error::MessageTooLarge { len: len.into(), max: max.into() });
    }
    let mut body = vec![0u8; len as usize];
    reader.read_exact(&mut body).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            Error::malformed("control message", format!("stream ended inside a {len}-byte message"))
        }
        _ => Error::io("reading control message body", e),
    })?;
    Ok(Some(body))
}

/// Decodes a request body, checking its version and that it has a body.
pub fn decode_request(bytes: &[u8]) -> Result<request::Body> {
    let message = Request::decode(bytes).map_err(|e| Error::malformed("control request", e.to_string()))?;
    if message.version != CONTROL_VERSION {
        return Err(Error::VersionMismatch { got: message.version, supported: CONTROL_VERSION });
    }
    message.body.ok_or_else(|| Error::malformed("control request", "no body"))
}

/// Decodes a response body, checking its version; an error reply becomes
/// [`Error::Remote`].
pub fn decode_response(bytes: &[u8]) -> Result<response::Body> {
    let message = Response::decode(bytes).map_err(|e| Error::malformed("control response", e.to_string()))?;
    if message.version != CONTROL_VERSION {
        return Err(Error::VersionMismatch { got: message.version, supported: CONTROL_VERSION });
    }
    match message.body {
        Some(response::Body::Error(reply)) => Err(Error::Remote {
            code: crate::proto::ErrorCode::try_from(reply.code).unwrap_or(crate::proto::ErrorCode::Internal),
            message: reply.message,
        }),
        Some(body) => Ok(body),
        None => Err(Error::malformed("control response", "no body")),
    }
}

/// A request with the current version.
pub fn request(body: request::Body) -> Request {
    Request { version: CONTROL_VERSION, body: Some(body) }
}

/// A response with the current version.
pub fn response(body: response::Body) -> Response {
    Response { version: CONTROL_VERSION, body: Some(body) }
}

/// An error reply carrying `error`'s code and message.
pub fn error_response(error: &Error) -> Response {
    response(response::Body::Error(crate::proto::ErrorReply { code: error.code() as i32, message: error.to_string() }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{ChecksumRequest, HandshakeRequest};

    #[test]
    fn frames_round_trip_and_oversized_ones_are_refused() {
        let mut wire = Vec::new();
        write_frame(
            &mut wire,
            &request(request::Body::Handshake(HandshakeRequest { initiator: "a".into(), ..Default::default() })),
        )
        .unwrap();
        let body = read_frame(&mut wire.as_slice(), MAX_CONTROL_MESSAGE_BYTES).unwrap().unwrap();
        assert!(matches!(decode_request(&body).unwrap(), request::Body::Handshake(h) if h.initiator == "a"));
        assert!(matches!(read_frame(&mut wire.as_slice(), 2), Err(Error::MessageTooLarge { max: 2, .. })));
        assert!(read_frame(&mut &b""[..], 10).unwrap().is_none());
        let err = read_frame(&mut &wire[..wire.len() - 1], 100).unwrap_err();
        assert!(err.to_string().contains("stream ended inside"), "{err}");
    }

    #[test]
    fn a_stranger_is_named_as_not_a_kvring_peer() {
        assert!(check_preface(&preface(), "peer").is_ok());
        let http = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n";
        let error = check_preface(http, "127.0.0.1:80").unwrap_err().to_string();
        assert!(error.contains("127.0.0.1:80 is not a kvring peer"), "{error}");
        assert!(error.contains("HTTP/1.1 400 Bad Request"), "{error}");
        let error = check_preface(b"", "x").unwrap_err().to_string();
        assert!(error.contains("it sent nothing"), "{error}");
        let mut old = preface();
        old[4] = 1;
        assert!(matches!(check_preface(&old, "x"), Err(Error::VersionMismatch { got: 1, supported: CONTROL_VERSION })));
    }

    #[test]
    fn wrong_version_and_garbage_get_clear_errors() {
        let mut message = request(request::Body::Checksum(ChecksumRequest { region: 1, offset: 0, len: 1 }));
        message.version = 2;
        let err = decode_request(&message.encode_to_vec()).unwrap_err();
        assert!(matches!(err, Error::VersionMismatch { got: 2, supported: CONTROL_VERSION }));
        assert!(matches!(decode_request(&[0xff, 0xff, 0xff]), Err(Error::Malformed { .. })));
        let empty = Request { version: CONTROL_VERSION, body: None };
        assert!(decode_request(&empty.encode_to_vec()).unwrap_err().to_string().contains("no body"));
        let reply = error_response(&Error::Shutdown).encode_to_vec();
        assert!(matches!(decode_response(&reply), Err(Error::Remote { code: crate::proto::ErrorCode::Shutdown, .. })));
    }
}
