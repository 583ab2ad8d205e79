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
            // SAFETY: `item` is a live object (above). The exact-int check
            // makes the conversion a plain read, with no `__index__` call.
            let value = unsafe {
                if item.is_null() || pyo3::ffi::PyLong_CheckExact(item) == 0 {
                    None
                } else {
                    // `unsigned long` is 64 bits on the LP64 targets kvring
                    // builds for, and CPython converts it with a digit
                    // loop (its `long long` path goes through a byte
                    // array, about 3x slower for addresses).
                    match pyo3::ffi::PyLong_AsUnsignedLong(item) {
                        // Also the error value (negative, too large): drop
                        // the error it may have set; the generic path below
                        // tells an error from the number and raises its own.
                        u64::MAX => {
                            pyo3::ffi::PyErr_Clear();
                            None
                        }
                        value => Some(value),
                    }
                }
            };
            match value {
                Some(value) => out.push(value),
                None => out.push(list.get_item(index)?.extract::<u64>()?),
            }
        }
        Ok(U64s(out))
    }
}
