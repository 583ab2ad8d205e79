//! The C ABI's configuration object: every key `kvring.toml` knows (the
//! RoCE GID index, traffic class, transports, host pinning, ...), set by
//! name with the same checks, then one engine made from it. A C or C++
//! engine reaches every option this way instead of through one
//! `kvring_engine_create_with_*` per option (split from `ffi.rs`; the same
//! conventions).

use super::{give, guarded, null, take_back, text, KvringEngine};
use crate::config::Config;
use std::ffi::{c_char, c_int};
use std::path::Path;

/// A configuration being built (opaque): kvring's defaults until keys are
/// set.
#[derive(Debug)]
pub struct KvringConfig(Config);

/// A configuration at kvring's defaults, in `*out` (free it with
/// `kvring_config_free`).
///
/// # Safety
///
/// `out` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn kvring_config_create(out: *mut *mut KvringConfig) -> c_int {
    guarded(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: `out` is valid (checked non-null, per our contract).
        unsafe { give(out, KvringConfig(Config::defaults())) }
    })
}

/// Sets one key, as `kvring.toml` names it (`"rdma_gid_index"`, `"lanes"`,
/// `"transports"`, ...; `kvring info` lists them) to `value`, as the
/// environment spells it (`"3"`, `"shm,tcp"`, `"on"`). An unknown key or a
/// bad value fails with `-INVALID_ARGUMENT`, and `kvring_last_error` names
/// the key and what it takes; the configuration is then unchanged.
///
/// # Safety
///
/// `config` came from `kvring_config_create`; `key` and `value` are
/// NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn kvring_config_set(
    config: *mut KvringConfig,
    key: *const c_char,
    value: *const c_char,
) -> c_int {
    guarded(|| {
        // SAFETY: null or a live configuration, per our contract.
        let config = unsafe { config.as_mut() }.ok_or_else(|| null("config"))?;
        // SAFETY: per our contract.
        let (key, value) = unsafe { (text(key, "key")?, text(value, "value")?) };
        config.0.set_by_call(key, value.to_string(), "kvring_config_set")?;
        Ok(0)
    })
}

/// Applies a `kvring.toml` file at `path` over what is set, as `kvring
/// serve --config` does; a key the file sets replaces an earlier value.
///
/// # Safety
///
/// `config` came from `kvring_config_create`; `path` is a NUL-terminated
/// string.
#[no_mangle]
pub unsafe extern "C" fn kvring_config_load_file(config: *mut KvringConfig, path: *const c_char) -> c_int {
    guarded(|| {
        // SAFETY: null or a live configuration, per our contract.
        let config = unsafe { config.as_mut() }.ok_or_else(|| null("config"))?;
        // SAFETY: per our contract.
        let path = Path::new(unsafe { text(path, "path")? });
        let contents = std::fs::read_to_string(path)
            .map_err(|e| crate::Error::io(format!("reading the config file {}", path.display()), e))?;
        config.0.apply_file(path, &contents)?;
        Ok(0)
    })
}

/// Applies this process's `KVRING_*` environment variables over what is
/// set, as `kvring serve` does; an unknown `KVRING_*` variable is an error
/// (a typo would otherwise be ignored).
///
/// # Safety
///
/// `config` came from `kvring_config_create`.
#[no_mangle]
pub unsafe extern "C" fn kvring_config_load_env(config: *mut KvringConfig) -> c_int {
    guarded(|| {
        // SAFETY: null or a live configuration, per our contract.
        let config = unsafe { config.as_mut() }.ok_or_else(|| null("config"))?;
        config.0.apply_env(std::env::vars())?;
        Ok(0)
    })
}

/// Frees a configuration (null is ignored). Engines made from it keep
/// their own copy of every setting.
///
/// # Safety
///
/// `config` came from `kvring_config_create` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn kvring_config_free(config: *mut KvringConfig) {
    // SAFETY: per our contract.
    unsafe { take_back(config) }
}

/// Starts an engine with every key of `config` applied (name, listen,
/// lanes, token, transports, RDMA and its GID index, ...), in `*out`. An
/// RDMA choice that cannot be honoured fails rather than leaving RDMA off:
/// `rdma = "on"` with no usable device, or devices named with `rdma =
/// "off"`.
///
/// # Safety
///
/// `config` came from `kvring_config_create`; `out` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn kvring_engine_create_from_config(
    config: *const KvringConfig,
    out: *mut *mut KvringEngine,
) -> c_int {
    guarded(|| {
        // SAFETY: null or a live configuration, per our contract.
        let config = unsafe { config.as_ref() }.ok_or_else(|| null("config"))?;
        if out.is_null() {
            return Err(null("out"));
        }
        let engine = config.0.try_builder()?.build()?;
        // SAFETY: `out` is valid (checked non-null, per our contract).
        unsafe { give(out, KvringEngine(engine)) }
    })
}
