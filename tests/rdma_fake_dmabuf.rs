//! The dma-buf rules of the two fakes GPU memory over RDMA runs on in CI
//! (.ci/stage-fakerdmagpu.sh): the fake libcuda exports device memory as a
//! dma-buf only as `cuMemGetHandleForAddressRange` documents it, and the
//! fake libibverbs registers one only as `ibv_reg_dmabuf_mr` (ibv_reg_mr(3))
//! does, and refuses a device address by `ibv_reg_mr` with no peer-memory
//! module, as the kernel does. Each refusal below is one the documentation
//! gives (the reference sits beside the rule in tests/fakes/*/src).
//!
//! Without both fakes on `LD_LIBRARY_PATH` each test says so and returns,
//! unless the stage asked for them (`FAKE_IBVERBS_REQUIRED`,
//! `FAKECUDA_REQUIRED`).

use kvring::gpu::{CudaGpu, DevicePtr, DmaBufRange, Gpu};
use kvring::rdma::{IbVerbs, MrAccess, Verbs};
use std::ffi::{c_int, c_void, CStr};
use std::os::fd::{AsFd, AsRawFd};

/// The real providers over both fakes, or `None` with the reason printed.
fn fakes() -> Option<(IbVerbs, CudaGpu)> {
    let verbs = IbVerbs::new();
    let listed = verbs.devices().map(|d| d.iter().any(|d| d.name == "fakeroce0")).unwrap_or(false);
    let gpu = CudaGpu::load().ok().filter(|_| symbol::<unsafe extern "C" fn()>(c"fakecuda_stat").is_some());
    match (listed, gpu) {
        (true, Some(gpu)) => Some((verbs, gpu)),
        _ => {
            let required = ["FAKE_IBVERBS_REQUIRED", "FAKECUDA_REQUIRED"].iter().any(|v| std::env::var_os(v).is_some());
            let why = "the fake libibverbs and the fake libcuda are not both on LD_LIBRARY_PATH";
            assert!(!required, "{why} (.ci/stage-fakerdmagpu.sh)");
            eprintln!("skipped: {why}");
            None
        }
    }
}

/// A function of the loaded libcuda, by name.
fn symbol<F: Copy>(name: &CStr) -> Option<F> {
    // SAFETY: dlopen of a library name and dlsym of a symbol; the caller
    // names the symbol's C signature.
    unsafe {
        let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW);
        let found = (!lib.is_null()).then(|| libc::dlsym(lib, name.as_ptr())).filter(|p| !p.is_null())?;
        Some(std::mem::transmute_copy::<*mut c_void, F>(&found))
    }
}

type HandleFor = unsafe extern "C" fn(*mut c_void, u64, usize, c_int, u64) -> u32;
type Attribute = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> u32;
const DMA_BUF_FD: c_int = 1;
const DMA_BUF_SUPPORTED: c_int = 124;
const INVALID_VALUE: u32 = 1;
const NOT_SUPPORTED: u32 = 801;

/// `cuMemGetHandleForAddressRange` for a dma-buf: the result and the fd.
fn export(dptr: u64, size: usize, kind: c_int) -> (u32, c_int) {
    let get: HandleFor = symbol(c"cuMemGetHandleForAddressRange").unwrap();
    let mut fd: c_int = -1;
    // SAFETY: writes one int; the fake checks the range itself.
    let result = unsafe { get((&mut fd as *mut c_int).cast(), dptr, size, kind, 0) };
    (result, fd)
}

fn dma_buf_supported() -> c_int {
    let attribute: Attribute = symbol(c"cuDeviceGetAttribute").unwrap();
    let mut value = -1;
    // SAFETY: writes one int.
    assert_eq!(unsafe { attribute(&mut value, DMA_BUF_SUPPORTED, 0) }, 0);
    value
}

#[test]
fn the_fake_libcuda_exports_page_aligned_ranges_of_one_allocation_as_a_dmabuf() {
    let Some((_, gpu)) = fakes() else { return };
    if std::env::var_os("FAKECUDA_DMABUF").is_some_and(|v| v == "0") {
        return without_dmabuf_support(&gpu);
    }
    let ptr = gpu.alloc(0, 4 << 20).unwrap();
    assert_eq!(dma_buf_supported(), 1);
    // [ref: 6.13, cuMemGetHandleForAddressRange]: the handle type must be
    // a dma-buf descriptor; dptr and size aligned to the host page size;
    // the range inside one allocation.
    assert_eq!(export(ptr.0, 65536, 2).0, INVALID_VALUE, "another handle type");
    assert_eq!(export(ptr.0 + 100, 65536, DMA_BUF_FD).0, INVALID_VALUE, "an address off a page");
    assert_eq!(export(ptr.0, 65536 + 100, DMA_BUF_FD).0, INVALID_VALUE, "a size off a page");
    assert_eq!(export(ptr.0 + (4 << 20) - 4096, 8192, DMA_BUF_FD).0, INVALID_VALUE, "past the allocation");
    let (result, fd) = export(ptr.0 + 65536, 65536, DMA_BUF_FD);
    assert_eq!(result, 0);
    assert!(fd >= 0);
    // SAFETY: the descriptor the driver handed us; closed once.
    unsafe { libc::close(fd) };
    // kvring's own export goes through the same rules.
    let buf = gpu.export_dmabuf(ptr.0 + 65536 + 100, 1000).unwrap();
    assert_eq!((buf.offset, buf.len), (100, 1000), "the range's first byte within the dma-buf's first page");
    drop(buf);
    // SAFETY: nothing uses the allocation.
    unsafe { gpu.free(ptr) }.unwrap();

    // Again with a device that reports no dma-buf support, in a child (the
    // fake reads FAKECUDA_DMABUF at cuInit).
    if std::env::var_os("RDMA_FAKE_DMABUF_CHILD").is_none() {
        let name = "the_fake_libcuda_exports_page_aligned_ranges_of_one_allocation_as_a_dmabuf";
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name, "--exact", "--nocapture"])
            .env("FAKECUDA_DMABUF", "0")
            .env("RDMA_FAKE_DMABUF_CHILD", "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success() && text.contains("1 passed"), "{text}");
    }
}

/// [ref: 6.13, cuMemGetHandleForAddressRange: the device must report
/// CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED]: with it 0 the export is refused,
/// and kvring says why without asking.
fn without_dmabuf_support(gpu: &CudaGpu) {
    let ptr = gpu.alloc(0, 2 << 20).unwrap();
    assert_eq!(dma_buf_supported(), 0);
    assert_eq!(export(ptr.0, 65536, DMA_BUF_FD).0, NOT_SUPPORTED);
    let refused = gpu.export_dmabuf(ptr.0, 65536).unwrap_err().to_string();
    assert!(refused.contains("cannot export its memory as dma-buf"), "{refused}");
    // SAFETY: nothing uses the allocation.
    unsafe { gpu.free(ptr) }.unwrap();
}

#[test]
fn the_fake_libibverbs_registers_a_dmabuf_as_ibv_reg_dmabuf_mr_documents_and_no_bare_device_address() {
    let Some((verbs, gpu)) = fakes() else { return };
    let context = verbs.open("fakeroce0").unwrap();
    let pd = verbs.alloc_pd(context).unwrap();
    let ptr: DevicePtr = gpu.alloc(0, 4 << 20).unwrap();
    let at = ptr.0 + 65536;
    let buf = gpu.export_dmabuf(at, 1 << 20).unwrap();
    let rw = MrAccess { local_write: true, remote_write: true, remote_read: true, relaxed_ordering: false };
    let fd = buf.fd.as_fd();
    let reg = |offset: u64, len: u64, iova: u64, access: MrAccess| {
        // SAFETY: the allocation outlives every registration made here
        // (each deregistered below before it is freed).
        unsafe { verbs.reg_dmabuf_mr(pd, DmaBufRange { fd, offset, len }, iova, access) }
    };
    let einval = std::io::Error::from_raw_os_error(libc::EINVAL).to_string();
    // Taken: the range, addressed by its device address, relaxed ordering
    // too (a flag ibv_reg_dmabuf_mr supports).
    let mr = reg(buf.offset, buf.len, at, rw).unwrap();
    verbs.dereg_mr(mr.handle).unwrap();
    let mr = reg(0, 4096, at, MrAccess { relaxed_ordering: true, ..rw }).unwrap();
    verbs.dereg_mr(mr.handle).unwrap();
    // ibv_reg_mr(3): iova "must have the same page offset as offset".
    let refused = reg(0, 4096, at + 8, rw).unwrap_err().to_string();
    assert!(refused.contains(&einval), "{refused}");
    // Past the dma-buf's end (the allocation's, on the fake: it cannot
    // tell the exported length from the descriptor).
    let refused = reg(0, 4 << 20, at, rw).unwrap_err().to_string();
    assert!(refused.contains(&einval), "{refused}");
    // ibv_reg_mr(3): REMOTE_WRITE needs LOCAL_WRITE.
    let refused = reg(0, 4096, at, MrAccess { local_write: false, ..rw }).unwrap_err().to_string();
    assert!(refused.contains(&einval), "{refused}");
    // A descriptor that is no dma-buf (the kernel's dma_buf_get: EINVAL).
    let null = std::fs::File::open("/dev/null").unwrap();
    // SAFETY: nothing is registered (refused).
    let refused = unsafe { verbs.reg_dmabuf_mr(pd, DmaBufRange { fd: null.as_fd(), offset: 0, len: 4096 }, 0, rw) }
        .unwrap_err()
        .to_string();
    assert!(refused.contains(&einval), "{refused}");
    // The device address itself, with no peer-memory module: the kernel
    // cannot pin it (EFAULT). Host memory by address still registers.
    // SAFETY: refused; nothing is registered.
    let refused = unsafe { verbs.reg_mr(pd, at, 4096, rw) }.unwrap_err().to_string();
    assert!(refused.contains(&std::io::Error::from_raw_os_error(libc::EFAULT).to_string()), "{refused}");
    let host = vec![0u8; 8192];
    // SAFETY: `host` outlives the registration (deregistered next).
    let mr = unsafe { verbs.reg_mr(pd, host.as_ptr() as u64, 8192, rw) }.unwrap();
    verbs.dereg_mr(mr.handle).unwrap();
    assert!(buf.fd.as_raw_fd() >= 0);
    drop(buf);
    verbs.dealloc_pd(pd).unwrap();
    verbs.close(context).unwrap();
    assert!(verbs.counts().balanced(), "{:?}", verbs.counts());
    // SAFETY: nothing uses the allocation.
    unsafe { gpu.free(ptr) }.unwrap();
}

type Flush = unsafe extern "C" fn(u32, u32) -> u32;
const INVALID_CONTEXT: u32 = 201;

/// `cuFlushGPUDirectRDMAWrites` of the fake, straight.
fn flush(target: u32, scope: u32) -> u32 {
    let flush: Flush = symbol(c"cuFlushGPUDirectRDMAWrites").unwrap();
    // SAFETY: no pointers.
    unsafe { flush(target, scope) }
}

fn gdr_flushes() -> i64 {
    type Stat = unsafe extern "C" fn(*const std::ffi::c_char) -> i64;
    let stat: Stat = symbol(c"fakecuda_stat").unwrap();
    // SAFETY: a NUL-terminated counter name.
    unsafe { stat(c"gdr_flushes".as_ptr()) }
}

/// Runs this binary's test `name` again in a child with `env`.
fn child(name: &str, env: &[(&str, &str)]) {
    let mut command = std::process::Command::new(std::env::current_exe().unwrap());
    command.args([name, "--exact", "--nocapture"]).env("RDMA_FAKE_DMABUF_CHILD", "1");
    for (key, value) in env {
        command.env(key, value);
    }
    let output = command.output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success() && text.contains("1 passed"), "{env:?}: {text}");
}

#[test]
fn the_fake_libcuda_flushes_gpudirect_rdma_writes_as_cu_flush_gpu_direct_rdma_writes_documents() {
    let Some((_, gpu)) = fakes() else { return };
    let (ordering, options) = (std::env::var("FAKECUDA_GDR_ORDERING"), std::env::var("FAKECUDA_GDR_FLUSH_OPTIONS"));
    if options.as_deref() == Ok("0") {
        // Without the HOST bit the call is unsupported, and kvring says why
        // rather than letting a notification overtake the data.
        let refused = gpu.flush_rdma_writes(0).unwrap_err().to_string();
        assert!(refused.contains("nor can flush them"), "{refused}");
        return;
    }
    if ordering.as_deref() == Ok("200") {
        // Ordered for every device: kvring skips the call, and the call
        // itself would be a no-op.
        let before = gdr_flushes();
        assert!(!gpu.flush_rdma_writes(0).unwrap());
        assert_eq!(gdr_flushes(), before);
        return;
    }
    // No context current on this thread (kvring puts the caller's back).
    assert_eq!(flush(0, 100), INVALID_CONTEXT);
    let before = gdr_flushes();
    assert!(gpu.flush_rdma_writes(0).unwrap(), "ordering none: flushed");
    assert!(gpu.flush_rdma_writes(1).unwrap());
    assert_eq!(gdr_flushes(), before + 2);
    // The target must be the current context (0) and the scope owner
    // (100) or all devices (200).
    type Retain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> u32;
    type SetCurrent = unsafe extern "C" fn(*mut c_void) -> u32;
    let (retain, set): (Retain, SetCurrent) =
        (symbol(c"cuDevicePrimaryCtxRetain").unwrap(), symbol(c"cuCtxSetCurrent").unwrap());
    let mut context = std::ptr::null_mut();
    // SAFETY: the fake's entry points with valid out-pointers.
    unsafe { assert_eq!((retain(&mut context, 0), set(context)), (0, 0)) };
    assert_eq!(flush(1, 100), INVALID_VALUE);
    assert_eq!(flush(0, 150), INVALID_VALUE);
    assert_eq!((flush(0, 100), flush(0, 200)), (0, 0));
    // SAFETY: as above; no context current again.
    unsafe { assert_eq!(set(std::ptr::null_mut()), 0) };
    if std::env::var_os("RDMA_FAKE_DMABUF_CHILD").is_none() {
        let name = "the_fake_libcuda_flushes_gpudirect_rdma_writes_as_cu_flush_gpu_direct_rdma_writes_documents";
        child(name, &[("FAKECUDA_GDR_FLUSH_OPTIONS", "0")]);
        child(name, &[("FAKECUDA_GDR_ORDERING", "200")]);
    }
}
