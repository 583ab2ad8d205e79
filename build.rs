//! Compiles proto/ with prost-build, fed by protox so no `protoc` is needed.

fn main() {
    let protos = ["proto/kvring/control.proto"];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(protos, ["proto"]).expect("proto/ must compile");
    prost_build::Config::new()
        // Keeps the descriptor (and every response holding it) small.
        .boxed(".kvring.control.v1.SegmentDescriptor.cma")
        // Keeps every response small beside the handshake's answer.
        .boxed(".kvring.control.v1.HandshakeResponse.segment")
        .compile_fds(descriptors)
        .expect("prost code generation");
}
