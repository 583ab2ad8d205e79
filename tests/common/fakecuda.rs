//! The fake CUDA driver's own control symbols (`fakecuda_stat`,
//! `fakecuda_set`, tests/fakes/cuda), found with `dlsym` in the
//! `libcuda.so.1` this process loaded: what tests read and inject goes
//! through them, never through kvring.

use std::ffi::{c_char, c_int, c_void, CStr};

/// The fake's entry points the tests call themselves (as PyTorch would).
#[derive(Clone)]
pub struct Fake {
    stat: unsafe extern "C" fn(*const c_char) -> i64,
    set: unsafe extern "C" fn(*const c_char, i64) -> c_int,
    lib: *mut c_void,
}

impl Fake {
    /// The fake driver this process loaded, or `None` (saying why) where
    /// the library is not the fake.
    pub fn find() -> Option<Fake> {
        // SAFETY: dlopen/dlsym of a library name and symbol names.
        unsafe {
            let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW);
            let stat = (!lib.is_null()).then(|| libc::dlsym(lib, c"fakecuda_stat".as_ptr())).filter(|p| !p.is_null());
            let set = (!lib.is_null()).then(|| libc::dlsym(lib, c"fakecuda_set".as_ptr())).filter(|p| !p.is_null());
            match (stat, set) {
                (Some(stat), Some(set)) => Some(Fake {
                    stat: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*const c_char) -> i64>(stat),
                    set: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*const c_char, i64) -> c_int>(set),
                    lib,
                }),
                _ => None,
            }
        }
    }

    pub fn stat(&self, name: &str) -> i64 {
        let name = std::ffi::CString::new(name).unwrap();
        // SAFETY: a NUL-terminated name.
        unsafe { (self.stat)(name.as_ptr()) }
    }

    pub fn set(&self, name: &str, value: i64) {
        let name = std::ffi::CString::new(name).unwrap();
        // SAFETY: a NUL-terminated name.
        assert_eq!(unsafe { (self.set)(name.as_ptr(), value) }, 0, "fakecuda_set {name:?}");
    }

    /// A driver function of the fake, by name.
    pub fn function<F: std::marker::Copy>(&self, name: &CStr) -> F {
        // SAFETY: a symbol of the fake, whose C signature the caller names.
        unsafe {
            let symbol = libc::dlsym(self.lib, name.as_ptr());
            assert!(!symbol.is_null(), "{name:?}");
            std::mem::transmute_copy::<*mut c_void, F>(&symbol)
        }
    }

    /// What an application on `cuda:device` has done before calling
    /// kvring: its device's primary context current on this thread.
    pub fn become_application_on(&self, device: c_int) {
        type Retain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> u32;
        type SetCurrent = unsafe extern "C" fn(*mut c_void) -> u32;
        let retain: Retain = self.function(c"cuDevicePrimaryCtxRetain");
        let set_current: SetCurrent = self.function(c"cuCtxSetCurrent");
        let mut context = std::ptr::null_mut();
        // SAFETY: the fake's entry points, with valid out-pointers.
        unsafe {
            assert_eq!(retain(&mut context, device), 0);
            assert_eq!(set_current(context), 0);
        }
    }

    /// `pieces` allocations of `piece` bytes (a multiple of the fake's
    /// granularity) on GPU 0 made with FABRIC
    /// handles only, mapped back to back in one reservation and granted to
    /// GPU 0, as an application (PyTorch's expandable segments on a host with
    /// IMEX channels) makes them: the run's address.
    pub fn fabric_run(&self, pieces: usize, piece: usize) -> u64 {
        use cudarc::driver::sys::{
            CUmemAccessDesc, CUmemAccess_flags, CUmemAllocationProp, CUmemLocation, CUmemLocationType,
        };
        type Create = unsafe extern "C" fn(*mut u64, usize, *const CUmemAllocationProp, u64) -> u32;
        type Reserve = unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> u32;
        type Map = unsafe extern "C" fn(u64, usize, usize, u64, u64) -> u32;
        type SetAccess = unsafe extern "C" fn(u64, usize, *const CUmemAccessDesc, usize) -> u32;
        self.become_application_on(0);
        let create: Create = self.function(c"cuMemCreate");
        let (reserve, map, access): (Reserve, Map, SetAccess) =
            (self.function(c"cuMemAddressReserve"), self.function(c"cuMemMap"), self.function(c"cuMemSetAccess"));
        // SAFETY: plain data; zero is valid for every field not set below.
        let mut prop: CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = cudarc::driver::sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes = cudarc::driver::sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;
        prop.location = CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 };
        let desc = CUmemAccessDesc {
            location: CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 },
            flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let mut at = 0u64;
        // SAFETY: the fake's entry points with valid out-pointers, properties
        // and one access descriptor.
        unsafe {
            assert_eq!(reserve(&mut at, pieces * piece, 0, 0, 0), 0);
            for i in 0..pieces {
                let mut handle = 0u64;
                assert_eq!(
                    create(&mut handle, piece, &prop, 0),
                    0,
                    "FABRIC memory (FAKECUDA_IMEX_CHANNEL, which the stage sets)"
                );
                assert_eq!(map(at + (i * piece) as u64, piece, 0, handle, 0), 0);
            }
            assert_eq!(access(at, pieces * piece, &desc, 1), 0);
        }
        at
    }

    /// `cuMemAlloc` under the calling thread's context, as `cudaMalloc`.
    pub fn application_alloc(&self, len: usize) -> u64 {
        type Alloc = unsafe extern "C" fn(*mut u64, usize) -> u32;
        let alloc: Alloc = self.function(c"cuMemAlloc_v2");
        let mut ptr = 0u64;
        // SAFETY: writes one pointer.
        assert_eq!(unsafe { alloc(&mut ptr, len) }, 0);
        ptr
    }

    /// `cuMemAllocManaged` (`CU_MEM_ATTACH_GLOBAL`) under the calling
    /// thread's context, as `cudaMallocManaged`.
    pub fn application_alloc_managed(&self, len: usize) -> u64 {
        type AllocManaged = unsafe extern "C" fn(*mut u64, usize, u32) -> u32;
        let alloc: AllocManaged = self.function(c"cuMemAllocManaged");
        let mut ptr = 0u64;
        // SAFETY: writes one pointer.
        assert_eq!(unsafe { alloc(&mut ptr, len, 1) }, 0);
        ptr
    }
}
