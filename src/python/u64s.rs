//! Lists of ints from Python, read fast.

use pyo3::prelude::*;
use pyo3::types::PyList;

/// A list of ints (addresses or lengths) taken from Python. Reading it is
/// most of the Python overhead of a 64-block batch: pyo3's generic path
/// costs ~35 ns an item under the stable ABI (a sequence protocol call and
/// an `__index__` conversion each), so a `list` of exact ints is read
/// through `PyList_GetItem` and `PyLong_AsUnsignedLong` directly;
/// anything else takes the generic path.
pub(super) struct U64s(pub(super) Vec<u64>);

// The fast path reads ints as `unsigned long`: 64 bits on LP64 Linux.
const _: () = assert!(std::mem::size_of::<std::os::raw::c_ulong>() == 8);

impl<'py> FromPyObject<'py> for U64s {
    fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        let Ok(list) = obj.downcast::<PyList>() else {
            return obj.extract::<Vec<u64>>().map(U64s);
        };
        let len = list.len();
        let mut out = Vec::with_capacity(len);
        for index in 0..len {
            // No Python code runs in this loop, so the list cannot shrink.
            // SAFETY: the GIL is held (we have a `Bound`) and `index` is below
            // the length read under it: PyList_GetItem gives a live, borrowed item.
            let item = unsafe { pyo3::ffi::PyList_GetItem(list.as_ptr(), index as pyo3::ffi::Py_ssize_t) };
            // SAFETY: `item` is null or a live, borrowed object (above),
            // and the GIL is held.
            match unsafe { exact_u64(item) } {
                Some(value) => out.push(value),
                // The generic path tells an error from the number and
                // raises its own.
                None => out.push(list.get_item(index)?.extract::<u64>()?),
            }
        }
        Ok(U64s(out))
    }
}

/// NIXL's descriptor rows (`(addr, len, dev_id)` tuples, with a meta str
/// or bytes fourth for `width` 4) packed as native-endian `u64` triples,
/// for `kvring.nixl`'s lists (vLLM passes 65,536 rows per handshake).
/// Only the common shape is taken: a list of exact tuples of `width`
/// items, the first three exact ints in `u64`, the fourth str or bytes.
/// Anything else gives None, and the Python layer checks the rows itself
/// (naming the bad row in its error); nothing here raises for a row.
#[pyfunction]
pub fn pack_desc_rows<'py>(
    py: Python<'py>,
    rows: &Bound<'py, PyAny>,
    width: usize,
) -> PyResult<Option<Bound<'py, pyo3::types::PyBytes>>> {
    let Ok(list) = rows.downcast::<PyList>() else { return Ok(None) };
    if width != 3 && width != 4 {
        return Ok(None);
    }
    let mut out: Vec<u64> = Vec::with_capacity(list.len() * 3);
    for index in 0..list.len() {
        // No Python code runs in this loop (exact types only, so no
        // `__index__` or `__len__` of a subclass), so the list and its
        // tuples cannot change under it.
        // SAFETY: the GIL is held and `index` is below the length read
        // under it: a live, borrowed item.
        let row = unsafe { pyo3::ffi::PyList_GetItem(list.as_ptr(), index as pyo3::ffi::Py_ssize_t) };
        // SAFETY: `row` is live (above); the checks are type reads.
        let shaped = unsafe {
            !row.is_null()
                && pyo3::ffi::PyTuple_CheckExact(row) != 0
                && pyo3::ffi::PyTuple_Size(row) == width as pyo3::ffi::Py_ssize_t
        };
        if !shaped {
            return Ok(None);
        }
        for field in 0..3 {
            // SAFETY: `row` is a live tuple of `width` >= 3 items, so
            // PyTuple_GetItem gives a live, borrowed item; the GIL is held.
            match unsafe { exact_u64(pyo3::ffi::PyTuple_GetItem(row, field)) } {
                Some(value) => out.push(value),
                // Not a plain u64 (or the error value): the Python layer
                // decides, with its own message.
                None => return Ok(None),
            }
        }
        if width == 4 {
            // SAFETY: `row` is a live tuple of 4 items; type checks only.
            let meta_ok = unsafe {
                let meta = pyo3::ffi::PyTuple_GetItem(row, 3);
                !meta.is_null() && (pyo3::ffi::PyUnicode_Check(meta) != 0 || pyo3::ffi::PyBytes_Check(meta) != 0)
            };
            if !meta_ok {
                return Ok(None);
            }
        }
    }
    let bytes: Vec<u8> = out.iter().flat_map(|v| v.to_ne_bytes()).collect();
    Ok(Some(pyo3::types::PyBytes::new(py, &bytes)))
}

/// `item` as a u64 when it is exactly an `int` that fits (the exact-int
/// check makes the conversion a plain read, with no `__index__` call);
/// `None` otherwise, with no Python error left set. `unsigned long` is 64
/// bits on the LP64 targets kvring builds for, and CPython converts it with
/// a digit loop (its `long long` path goes through a byte array, about 3x
/// slower for addresses).
///
/// # Safety
///
/// `item` is null or a live object, and the GIL is held.
unsafe fn exact_u64(item: *mut pyo3::ffi::PyObject) -> Option<u64> {
    // SAFETY: per our contract.
    unsafe {
        if item.is_null() || pyo3::ffi::PyLong_CheckExact(item) == 0 {
            return None;
        }
        match pyo3::ffi::PyLong_AsUnsignedLong(item) {
            // Also the error value (negative, too large): drop the error
            // it may have set; the caller decides.
            u64::MAX => {
                pyo3::ffi::PyErr_Clear();
                None
            }
            value => Some(value),
        }
    }
}
