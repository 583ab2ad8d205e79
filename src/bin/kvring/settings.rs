//! The layered configuration as the commands see it: a config file
//! (`--config PATH`, else `$KVRING_CONFIG`, else `./kvring.toml` when it
//! exists), then `KVRING_*` variables, then the flags named after keys.

use crate::args::Args;
use kvring::config::{Config, KEYS};
use std::path::PathBuf;

/// The config file to read, if any.
fn config_path(args: &mut Args) -> Result<Option<PathBuf>, String> {
    if let Some(path) = args.value("--config")? {
        return Ok(Some(path.into()));
    }
    if let Ok(path) = std::env::var("KVRING_CONFIG") {
        return Ok(Some(path.into()));
    }
    let local = PathBuf::from("kvring.toml");
    Ok(local.is_file().then_some(local))
}

/// Resolves the configuration; the flags for `keys` (all when `None`) are
/// consumed from `args`.
pub fn load(args: &mut Args, keys: Option<&[&str]>) -> Result<Config, String> {
    let path = config_path(args)?;
    let mut config = Config::load(path.as_deref(), std::env::vars()).map_err(|e| e.to_string())?;
    for key in KEYS.iter().filter(|k| keys.is_none_or(|keys| keys.contains(&k.name))) {
        if let Some(value) = args.value(&format!("--{}", key.name.replace('_', "-")))? {
            config.set_flag(key.name, value).map_err(|e| e.to_string())?;
        }
    }
    Ok(config)
}
