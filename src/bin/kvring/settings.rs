//! The layered configuration as the commands see it: a config file
//! (`--config PATH`, else `$KVRING_CONFIG`, else `./kvring.toml` when it
//! exists), then `KVRING_*` variables, then the flags named after keys.

use kvring::config::Config;
use std::path::{Path, PathBuf};

/// The config file to read, if any.
fn config_path(flag: Option<&Path>) -> Option<PathBuf> {
    if let Some(path) = flag {
        return Some(path.to_path_buf());
    }
    if let Ok(path) = std::env::var("KVRING_CONFIG") {
        return Some(path.into());
    }
    let local = PathBuf::from("kvring.toml");
    local.is_file().then_some(local)
}

/// Resolves the configuration: the file (`--config`, else the usual
/// places), the `KVRING_*` variables, then `flags` (`(key, value)` pairs
/// from the command line, checked as any other source's values are).
pub fn load(config: Option<&Path>, flags: &[(&'static str, String)]) -> Result<Config, String> {
    let path = config_path(config);
    let mut config = Config::load(path.as_deref(), std::env::vars()).map_err(|e| e.to_string())?;
    for (key, value) in flags {
        config.set_flag(key, value.clone()).map_err(|e| e.to_string())?;
    }
    Ok(config)
}

/// [`load`] for a command with the key flags ([`crate::args::Layered`]).
pub fn load_layered(layered: &crate::args::Layered) -> Result<Config, String> {
    load(layered.config.as_deref(), &layered.keys.values)
}
