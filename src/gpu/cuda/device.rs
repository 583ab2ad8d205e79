//! One GPU as kvring lists it: its name, memory, PCI address and the host
//! NUMA node nearest it (which NIC carries its memory, which cores serve
//! it).

use super::{check, sys};
use crate::error::Result;
use crate::gpu::GpuDevice;
use std::ffi::{c_char, c_int, CStr};

/// One device's name, memory, PCI address and NUMA node.
pub(super) fn describe(ordinal: u32, device: sys::CUdevice) -> Result<GpuDevice> {
    let mut name = [0 as c_char; 256];
    // SAFETY: writes at most `name.len()` bytes, NUL-terminated.
    check(unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, device) }, "naming a GPU")?;
    let mut memory: usize = 0;
    // SAFETY: writes one size.
    check(unsafe { sys::cuDeviceTotalMem_v2(&mut memory, device) }, "sizing a GPU's memory")?;
    let mut bus = [0 as c_char; 32];
    // SAFETY: writes at most `bus.len()` bytes, NUL-terminated.
    let bus_known = unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as c_int, device) }
        == sys::CUresult::CUDA_SUCCESS;
    // SAFETY: both buffers were NUL-terminated by the driver (zeroed before).
    let text = |buffer: &[c_char]| unsafe { CStr::from_ptr(buffer.as_ptr()) }.to_string_lossy().into_owned();
    let pci_bus = bus_known.then(|| text(&bus).to_lowercase());
    let numa_node = match host_numa_id(device) {
        Some(answer) => answer,
        // A driver older than 12.2: the PCI device's node in sysfs.
        None => pci_bus.as_deref().and_then(|bus| {
            let path = format!("/sys/bus/pci/devices/{bus}/numa_node");
            std::fs::read_to_string(path).ok()?.trim().parse::<i64>().ok().and_then(|n| u32::try_from(n).ok())
        }),
    };
    Ok(GpuDevice { ordinal, name: text(&name), memory_bytes: memory as u64, pci_bus, numa_node })
}

/// The driver's answer for the host NUMA node nearest `device`
/// (`CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID`, CUDA 12.2: "NUMA ID of the host
/// node closest to the device. Returns -1 when system does not support
/// NUMA"): `Some(None)` for -1, `None` where the driver does not know the
/// attribute. Asked first, so a container that hides `/sys/bus/pci` still
/// places a GPU's NIC and lanes.
fn host_numa_id(device: sys::CUdevice) -> Option<Option<u32>> {
    let mut value: c_int = -1;
    let attribute = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID;
    // SAFETY: writes one int.
    let asked = unsafe { sys::cuDeviceGetAttribute(&mut value, attribute, device) };
    (asked == sys::CUresult::CUDA_SUCCESS).then(|| u32::try_from(value).ok())
}
