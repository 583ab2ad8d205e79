//! Configuration: `kvring.toml`, then `KVRING_*` environment variables,
//! then flags, each overriding the one before, every value remembering
//! where it came from (`kvring info` prints it).
//!
//! ```toml
//! version = 1
//! name = "decode-0"
//! listen = "0.0.0.0:7000"
//! lanes = 2
//! metadata = "etcd://10.0.0.5:2379"
//! metrics = "0.0.0.0:9400"
//! io_timeout = "5s"
//! ```
//!
//! A file of another `version`, an unknown key (in the file or as a
//! `KVRING_*` variable), or a value that does not parse is an error naming
//! the key, the value and where it came from.

mod units;

pub use units::{parse_duration, parse_size};

use crate::error::{Error, Result};
use crate::metadata::MetadataMode;
use crate::EngineBuilder;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

/// The only file version this kvring reads.
pub const CONFIG_VERSION: i64 = 1;
/// Environment variables that are not settings but are read elsewhere
/// (the advertised-address order, the config path, where sysfs lists RDMA
/// devices: a test tree beside a fake libibverbs; where sysfs is, for the
/// GPU-to-NIC line of `kvring info` and `kvring bench`: a test tree).
pub const OTHER_VARIABLES: [&str; 4] =
    ["KVRING_HOST_IP", "KVRING_CONFIG", "KVRING_RDMA_SYSFS_ROOT", "KVRING_SYSFS_ROOT"];

/// What kind of value a key takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Free text.
    Text,
    /// A whole number.
    Count,
    /// `500ms`, `5s`, `2m`.
    Duration,
    /// `4KiB`, `256MiB`.
    Size,
    /// `ip:port`.
    SocketAddr,
    /// An IP address.
    Ip,
    /// `P2PHANDSHAKE` or `etcd://host:port[/prefix/]` ([`MetadataMode`]).
    Metadata,
    /// A CPU list such as `2-5,8`.
    Cores,
    /// `on` or `off` (`true`/`false` too).
    Switch,
    /// `auto`, `on` or `off`.
    Mode,
    /// A whole number from 0 to 255.
    Byte,
    /// Transport names, comma-separated (`shm,tcp`; a TOML array of
    /// strings in the file).
    Transports,
}

/// A transport list's value: names, comma-separated (spaces allowed).
pub fn parse_transports(value: &str) -> Result<Vec<crate::TransportKind>> {
    value.split(',').map(str::trim).filter(|n| !n.is_empty()).map(crate::TransportKind::parse).collect()
}

/// A switch's value: `on`/`true` or `off`/`false`.
pub fn parse_switch(value: &str) -> Option<bool> {
    match value {
        "on" | "true" => Some(true),
        "off" | "false" => Some(false),
        _ => None,
    }
}

/// One configurable key.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    /// Its name in the file; `KVRING_<NAME>` in the environment; `--name`
    /// (underscores as dashes) as a flag.
    pub name: &'static str,
    /// What it takes.
    pub kind: Kind,
    /// Its default, as text (`None`: unset).
    pub default: Option<&'static str>,
    /// What it sets.
    pub help: &'static str,
}

/// Every key, in the order `kvring info` prints them.
pub const KEYS: &[Key] = &[
    Key { name: "name", kind: Kind::Text, default: None, help: "segment name peers see (default kvring-<pid>)" },
    Key { name: "listen", kind: Kind::SocketAddr, default: Some("127.0.0.1:0"), help: "control-plane address" },
    Key { name: "advertise", kind: Kind::Ip, default: None, help: "address told to peers when listening on 0.0.0.0" },
    Key { name: "lanes", kind: Kind::Count, default: Some("1"), help: "poller threads, one per core" },
    Key {
        name: "cores",
        kind: Kind::Cores,
        default: None,
        help: "cores the lanes run on, round robin (default: every core but the first)",
    },
    Key {
        name: "gpu_device",
        kind: Kind::Count,
        default: None,
        help: "the GPU this engine serves: lanes run on its NUMA node's cores (unset: the GPUs' node, if one)",
    },
    Key {
        name: "metadata",
        kind: Kind::Metadata,
        default: Some("P2PHANDSHAKE"),
        help: "P2PHANDSHAKE, etcd://host:port[/prefix/], redis://host:port[/db] or http://host:port/metadata",
    },
    Key { name: "metadata_ttl", kind: Kind::Duration, default: Some("10s"), help: "lease of the published descriptor" },
    Key { name: "metadata_poll", kind: Kind::Duration, default: Some("1s"), help: "re-read of open segments' entries" },
    Key { name: "metrics", kind: Kind::SocketAddr, default: None, help: "where /metrics is served (off if unset)" },
    Key { name: "token", kind: Kind::Text, default: None, help: "pre-shared token for handshakes" },
    Key {
        name: "cma",
        kind: Kind::Switch,
        default: Some("on"),
        help: "cross-memory attach with same-host peers (process_vm_*), both ways",
    },
    Key {
        name: "pin_host_memory",
        kind: Kind::Switch,
        default: Some("off"),
        help: "pin registered host memory for GPU copies (memory its owner pinned is used as it is)",
    },
    Key {
        name: "checksum",
        kind: Kind::Switch,
        default: Some("off"),
        help:
            "CRC32C of every block, verified at its destination before its batch is done (per batch: Batch::checksum)",
    },
    Key {
        name: "transports",
        kind: Kind::Transports,
        default: None,
        help: "transports peers may be reached by, e.g. shm,tcp (one: required; unset: all); others are refused",
    },
    Key { name: "io_timeout", kind: Kind::Duration, default: Some("5s"), help: "tcp silence before a peer is dead" },
    Key { name: "control_timeout", kind: Kind::Duration, default: Some("5s"), help: "deadline of control RPCs" },
    Key { name: "busy_poll", kind: Kind::Duration, default: Some("2ms"), help: "spin before an idle lane parks" },
    Key { name: "segment_cache", kind: Kind::Count, default: Some("256"), help: "open segments kept (LRU)" },
    Key { name: "notify_queue", kind: Kind::Count, default: Some("4096"), help: "notifications queued" },
    Key { name: "region_size", kind: Kind::Size, default: Some("256MiB"), help: "region `kvring serve` exposes" },
    Key {
        name: "rdma",
        kind: Kind::Mode,
        default: Some("auto"),
        help: "RDMA over libibverbs: auto (when a device has an active port), on (or fail), off",
    },
    Key {
        name: "rdma_devices",
        kind: Kind::Text,
        default: None,
        help: "RDMA devices to use, comma-separated (all if unset)",
    },
    Key {
        name: "rdma_traffic_class",
        kind: Kind::Byte,
        default: Some("0"),
        help: "RoCE GRH traffic class (DSCP << 2)",
    },
    Key {
        name: "rdma_service_level",
        kind: Kind::Byte,
        default: Some("0"),
        help: "InfiniBand service level / RoCE priority",
    },
    Key {
        name: "rdma_gid_index",
        kind: Kind::Byte,
        default: None,
        help: "RoCE GID index of every port (unset: RoCE v2 with an IPv4-mapped address first)",
    },
];

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// kvring's default.
    Default,
    /// A config file.
    File(PathBuf),
    /// An environment variable.
    Env(String),
    /// A command-line flag.
    Flag(String),
    /// A program's call (the C ABI's `kvring_config_set`).
    Call(&'static str),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::File(path) => write!(f, "{}", path.display()),
            Source::Env(var) => write!(f, "${var}"),
            Source::Flag(flag) => f.write_str(flag),
            Source::Call(call) => f.write_str(call),
        }
    }
}

/// One key's resolved value.
#[derive(Debug, Clone)]
pub struct Setting {
    /// The key.
    pub key: &'static Key,
    /// Its value as text, if set.
    pub value: Option<String>,
    /// Where the value came from.
    pub source: Source,
}

/// Resolved configuration: one [`Setting`] per key of [`KEYS`].
#[derive(Debug, Clone)]
pub struct Config {
    settings: Vec<Setting>,
}

impl Default for Config {
    fn default() -> Self {
        Self::defaults()
    }
}

fn check(key: &Key, value: &str) -> std::result::Result<(), String> {
    let ok = match key.kind {
        Kind::Text => !value.is_empty(),
        Kind::Count => value.parse::<usize>().is_ok_and(|n| n > 0),
        Kind::Duration => parse_duration(value).is_ok(),
        Kind::Size => parse_size(value).is_ok_and(|n| n > 0),
        Kind::SocketAddr => value.parse::<SocketAddr>().is_ok(),
        Kind::Ip => value.parse::<IpAddr>().is_ok(),
        Kind::Metadata => MetadataMode::parse(value).is_ok(),
        Kind::Cores => crate::runtime::placement::parse_cpu_list(value).is_some_and(|c| !c.is_empty()),
        Kind::Switch => parse_switch(value).is_some(),
        Kind::Mode => matches!(value, "auto" | "on" | "off"),
        Kind::Byte => value.parse::<u8>().is_ok(),
        Kind::Transports => parse_transports(value).is_ok_and(|list| !list.is_empty()),
    };
    if ok {
        return Ok(());
    }
    let expected = match key.kind {
        Kind::Text => "a non-empty string",
        Kind::Count => "a whole number above 0",
        Kind::Duration => "a duration such as 500ms or 5s",
        Kind::Size => "a size such as 4KiB or 256MiB",
        Kind::SocketAddr => "an ip:port address",
        Kind::Ip => "an IP address",
        Kind::Metadata => "P2PHANDSHAKE, etcd://, redis:// or http://host:port/metadata",
        Kind::Cores => "a CPU list such as 1 or 2-5,8",
        Kind::Switch => "on or off",
        Kind::Mode => "auto, on or off",
        Kind::Byte => "a whole number from 0 to 255",
        Kind::Transports => "a list of transports from shm, cuda_ipc, cma, tcp, rdma, null",
    };
    Err(format!("{value:?} is not {expected}"))
}

impl Config {
    /// Every key at its default.
    pub fn defaults() -> Self {
        Self {
            settings: KEYS
                .iter()
                .map(|key| Setting { key, value: key.default.map(str::to_string), source: Source::Default })
                .collect(),
        }
    }

    /// Defaults, then `file` (if given), then the `KVRING_*` variables of
    /// `env`.
    pub fn load(file: Option<&Path>, env: impl IntoIterator<Item = (String, String)>) -> Result<Self> {
        let mut config = Self::defaults();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::io(format!("reading the config file {}", path.display()), e))?;
            config.apply_file(path, &text)?;
        }
        config.apply_env(env)?;
        Ok(config)
    }

    /// Applies a config file's text.
    pub fn apply_file(&mut self, path: &Path, text: &str) -> Result<()> {
        let place = path.display().to_string();
        let bad = |why: String| Error::invalid("config", format!("{place}: {why}"));
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| bad(e.message().to_string()))?;
        match table.get("version") {
            Some(toml::Value::Integer(CONFIG_VERSION)) => {}
            Some(other) => {
                return Err(bad(format!("unknown version {other} (this kvring reads version {CONFIG_VERSION})")))
            }
            None => return Err(bad(format!("no version (write `version = {CONFIG_VERSION}` first)"))),
        }
        for (name, value) in &table {
            if name == "version" {
                continue;
            }
            let text = match value {
                toml::Value::String(text) => text.clone(),
                toml::Value::Integer(number) => number.to_string(),
                toml::Value::Boolean(on) => on.to_string(),
                // A list (`transports = ["shm", "tcp"]`): its strings, as
                // the environment spells them.
                toml::Value::Array(items) if items.iter().all(toml::Value::is_str) => {
                    items.iter().filter_map(toml::Value::as_str).collect::<Vec<_>>().join(",")
                }
                other => {
                    return Err(bad(format!(
                        "{name}: {other} is neither a string, a number, a boolean nor a list of strings"
                    )))
                }
            };
            self.set(name, text, Source::File(path.to_path_buf())).map_err(bad)?;
        }
        Ok(())
    }

    /// Applies `KVRING_<KEY>` variables; an unknown `KVRING_*` is an error
    /// (a typo would otherwise be ignored), except [`OTHER_VARIABLES`].
    pub fn apply_env(&mut self, env: impl IntoIterator<Item = (String, String)>) -> Result<()> {
        for (var, value) in env {
            let Some(name) = var.strip_prefix("KVRING_") else { continue };
            if OTHER_VARIABLES.contains(&var.as_str()) {
                continue;
            }
            let name = name.to_ascii_lowercase();
            self.set(&name, value, Source::Env(var.clone()))
                .map_err(|e| Error::invalid("config", format!("${var}: {e}")))?;
        }
        Ok(())
    }

    /// Sets `key` from a flag (the CLI passes the flags it parsed).
    pub fn set_flag(&mut self, key: &str, value: String) -> Result<()> {
        let flag = format!("--{}", key.replace('_', "-"));
        self.set(key, value, Source::Flag(flag.clone())).map_err(|e| Error::invalid("config", format!("{flag}: {e}")))
    }

    /// Sets `key` from a program's `call`: an error names the call and the
    /// key.
    pub fn set_by_call(&mut self, key: &str, value: String, call: &'static str) -> Result<()> {
        self.set(key, value, Source::Call(call)).map_err(|e| Error::invalid("config", format!("{call}: {e}")))
    }

    /// Sets a key, or says why not (the caller names the source).
    fn set(&mut self, name: &str, value: String, source: Source) -> std::result::Result<(), String> {
        let Some(setting) = self.settings.iter_mut().find(|s| s.key.name == name) else {
            let known: Vec<_> = KEYS.iter().map(|k| k.name).collect();
            return Err(format!("unknown key {name:?} (known: {})", known.join(", ")));
        };
        check(setting.key, &value).map_err(|why| format!("{name}: {why}"))?;
        setting.value = Some(value);
        setting.source = source;
        Ok(())
    }

    /// Every key's setting, in [`KEYS`] order.
    pub fn settings(&self) -> &[Setting] {
        &self.settings
    }

    /// A key's value as text.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.settings.iter().find(|s| s.key.name == name).and_then(|s| s.value.as_deref())
    }

    /// A key's setting.
    pub fn setting(&self, name: &str) -> Option<&Setting> {
        self.settings.iter().find(|s| s.key.name == name)
    }

    // Values were checked when set, so these parses cannot fail; a key of
    // another kind reads as unset.
    fn duration(&self, name: &str) -> Option<std::time::Duration> {
        self.get(name).and_then(|v| parse_duration(v).ok())
    }

    fn count(&self, name: &str) -> Option<usize> {
        self.get(name).and_then(|v| v.parse().ok())
    }

    /// A size key's value in bytes.
    pub fn size(&self, name: &str) -> Option<u64> {
        self.get(name).and_then(|v| parse_size(v).ok())
    }

    /// An engine builder with every engine key applied.
    pub fn builder(&self) -> EngineBuilder {
        self.rdma(self.engine_keys(), false)
    }

    /// As [`Config::builder`], but an RDMA choice that cannot be honoured
    /// (devices named while `rdma` is off) is an error rather than RDMA
    /// left off: what a program's call wants (the C ABI's
    /// `kvring_engine_create_from_config`).
    pub fn try_builder(&self) -> Result<EngineBuilder> {
        let (mode, devices, options) = self.rdma_keys(false);
        with_rdma(self.engine_keys(), mode, devices, options)
    }

    /// Every engine key but the RDMA ones.
    fn engine_keys(&self) -> EngineBuilder {
        let mut builder = crate::Engine::builder();
        if let Some(name) = self.get("name") {
            builder = builder.name(name);
        }
        if let Some(listen) = self.get("listen").and_then(|v| v.parse().ok()) {
            builder = builder.listen(listen);
        }
        if let Some(ip) = self.get("advertise").and_then(|v| v.parse().ok()) {
            builder = builder.advertise(ip);
        }
        if let Some(lanes) = self.count("lanes") {
            builder = builder.lanes(lanes);
        }
        if let Some(cores) = self.get("cores").and_then(crate::runtime::placement::parse_cpu_list) {
            builder = builder.cores(cores);
        }
        if let Some(device) = self.count("gpu_device") {
            builder = builder.gpu_device(device as u32);
        }
        if let Some(mode) = self.get("metadata").and_then(|v| MetadataMode::parse(v).ok()) {
            builder = builder.metadata(mode);
        }
        if let Some(ttl) = self.duration("metadata_ttl") {
            builder = builder.metadata_ttl(ttl);
        }
        if let Some(poll) = self.duration("metadata_poll") {
            builder = builder.metadata_poll(poll);
        }
        if let Some(addr) = self.get("metrics").and_then(|v| v.parse().ok()) {
            builder = builder.metrics(addr);
        }
        if let Some(token) = self.get("token") {
            builder = builder.token(token);
        }
        if let Some(on) = self.get("cma").and_then(parse_switch) {
            builder = builder.cma(on);
        }
        if let Some(on) = self.get("pin_host_memory").and_then(parse_switch) {
            builder = builder.pin_host_memory(on);
        }
        if let Some(on) = self.get("checksum").and_then(parse_switch) {
            builder = builder.checksum(on);
        }
        if let Some(allowed) = self.get("transports").and_then(|v| parse_transports(v).ok()) {
            builder = builder.transports(allowed);
        }
        if let Some(timeout) = self.duration("io_timeout") {
            builder = builder.io_timeout(timeout);
        }
        if let Some(timeout) = self.duration("control_timeout") {
            builder = builder.control_timeout(timeout);
        }
        if let Some(window) = self.duration("busy_poll") {
            builder = builder.busy_poll(window);
        }
        if let Some(capacity) = self.count("segment_cache") {
            builder = builder.segment_cache_capacity(capacity);
        }
        if let Some(capacity) = self.count("notify_queue") {
            builder = builder.notify_queue(capacity);
        }
        match self.get("rdma_gid_index").and_then(|v| v.parse::<u8>().ok()) {
            Some(index) => builder.rdma_gid_index(index),
            None => builder,
        }
    }

    /// The RDMA keys: mode (`required` makes `auto` mean `on`), devices and
    /// per-port options.
    fn rdma_keys(&self, required: bool) -> (&str, Vec<String>, crate::rdma::IbOptions) {
        let mode = match (self.get("rdma").unwrap_or("auto"), required) {
            (_, true) => "on",
            (mode, false) => mode,
        };
        let devices: Vec<String> = self.get("rdma_devices").unwrap_or("").split(',').map(str::to_string).collect();
        let byte = |name| self.get(name).and_then(|v| v.parse::<u8>().ok()).unwrap_or(0);
        let options = crate::rdma::IbOptions {
            traffic_class: byte("rdma_traffic_class"),
            service_level: byte("rdma_service_level"),
        };
        (mode, devices, options)
    }

    /// `builder` with the RDMA keys applied (see [`with_rdma`]); `required`
    /// makes `auto` mean `on` (`kvring bench --transport rdma`).
    pub fn rdma(&self, builder: EngineBuilder, required: bool) -> EngineBuilder {
        let (mode, devices, options) = self.rdma_keys(required);
        let builder = match self.get("rdma_gid_index").and_then(|v| v.parse::<u8>().ok()) {
            Some(index) => builder.rdma_gid_index(index),
            None => builder,
        };
        // The value was checked when set, so the mode parses.
        with_rdma(builder.clone(), mode, devices, options).unwrap_or(builder)
    }
}

/// The RDMA choice every entry point shares (the config file and
/// `KVRING_RDMA*`, Python's `Engine(rdma=...)`, the C ABI): `off` leaves
/// `builder` alone; `on` gives it the real provider (the build then fails
/// with the reason where there is no libibverbs or device); `auto` does so
/// only where libibverbs lists a device with an active port. Named
/// `devices` (empty names ignored) imply `on`: they are used or refused,
/// never replaced by another NIC.
pub fn with_rdma(
    builder: EngineBuilder,
    mode: &str,
    devices: Vec<String>,
    options: crate::rdma::IbOptions,
) -> crate::error::Result<EngineBuilder> {
    use crate::transport::rdma::ibverbs::IbVerbs;
    use crate::transport::rdma::verbs::Verbs;
    let devices: Vec<String> = devices.into_iter().map(|d| d.trim().to_string()).filter(|d| !d.is_empty()).collect();
    let wanted = match mode {
        "off" if devices.is_empty() => return Ok(builder),
        "off" => return Err(crate::error::Error::invalid("rdma", "devices were named but rdma is off")),
        "on" => true,
        "auto" => !devices.is_empty(),
        other => return Err(crate::error::Error::invalid("rdma", format!("{other:?} is not auto, on or off"))),
    };
    let verbs = IbVerbs::with_options(options);
    if !wanted && !verbs.devices().is_ok_and(|d| d.iter().any(|d| d.ports.iter().any(|p| p.active))) {
        return Ok(builder);
    }
    Ok(builder.rdma(std::sync::Arc::new(verbs)).rdma_devices(devices))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn file_then_environment_then_flags_each_override_and_say_so() {
        let mut config = Config::defaults();
        let path = Path::new("/etc/kvring.toml");
        config
            .apply_file(path, "version = 1\nname = \"decode-0\"\nlanes = 2\nio_timeout = \"3s\"\nbusy_poll = \"1ms\"\n")
            .unwrap();
        config.apply_env(env(&[("KVRING_LANES", "4"), ("KVRING_HOST_IP", "10.0.0.9"), ("PATH", "/bin")])).unwrap();
        config.set_flag("io_timeout", "9s".into()).unwrap();
        let source = |key: &str| config.setting(key).unwrap().source.clone();
        assert_eq!((config.get("name"), source("name")), (Some("decode-0"), Source::File(path.into())));
        assert_eq!((config.get("lanes"), source("lanes")), (Some("4"), Source::Env("KVRING_LANES".into())));
        assert_eq!((config.get("io_timeout"), source("io_timeout")), (Some("9s"), Source::Flag("--io-timeout".into())));
        assert_eq!((config.get("busy_poll"), source("busy_poll")), (Some("1ms"), Source::File(path.into())));
        assert_eq!((config.get("listen"), source("listen")), (Some("127.0.0.1:0"), Source::Default));
        assert_eq!(config.get("metrics"), None);
        assert_eq!(config.size("region_size"), Some(256 << 20));
        assert_eq!(source("io_timeout").to_string(), "--io-timeout");
        assert_eq!(source("lanes").to_string(), "$KVRING_LANES");
    }

    #[test]
    fn wrong_versions_unknown_keys_and_bad_values_are_named() {
        let path = Path::new("kvring.toml");
        let cases = [
            ("version = 2\n", "unknown version 2"),
            ("name = \"x\"\n", "no version"),
            ("version = 1\nlanez = 2\n", "unknown key \"lanez\""),
            ("version = 1\nlanes = 0\n", "lanes: \"0\" is not a whole number above 0"),
            ("version = 1\nio_timeout = \"5 parsecs\"\n", "io_timeout: \"5 parsecs\" is not a duration"),
            ("version = 1\nlisten = \"nowhere\"\n", "listen: \"nowhere\" is not an ip:port address"),
            ("version = 1\nlanes = [1]\n", "neither a string, a number, a boolean nor a list of strings"),
            ("version = 1\ntransports = [\"shm\", \"ib\"]\n", "transports: \"shm,ib\" is not a list of transports"),
            ("version = 1\ntransports = []\n", "transports: \"\" is not a list of transports"),
            ("version = 1\nname = \n", "kvring.toml"),
        ];
        for (text, why) in cases {
            let error = Config::defaults().apply_file(path, text).unwrap_err().to_string();
            assert!(error.contains(why) && error.contains("kvring.toml"), "{text:?}: {error} should say {why}");
        }
        let error = Config::defaults().apply_env(env(&[("KVRING_LANSE", "2")])).unwrap_err().to_string();
        assert!(error.contains("$KVRING_LANSE") && error.contains("unknown key \"lanse\""), "{error}");
        let error = Config::defaults().apply_env(env(&[("KVRING_METRICS", "9400")])).unwrap_err().to_string();
        assert!(error.contains("$KVRING_METRICS: metrics: \"9400\" is not an ip:port address"), "{error}");
        let error = Config::defaults().set_flag("busy_poll", "soon".into()).unwrap_err().to_string();
        assert!(error.contains("--busy-poll"), "{error}");
    }

    #[test]
    fn transports_come_as_a_toml_list_or_a_comma_separated_variable() {
        let mut config = Config::defaults();
        assert_eq!(config.get("transports"), None, "every transport unless set");
        config.apply_file(Path::new("kvring.toml"), "version = 1\ntransports = [\"shm\", \"tcp\"]\n").unwrap();
        assert_eq!(config.get("transports"), Some("shm,tcp"));
        config.apply_env(env(&[("KVRING_TRANSPORTS", "cma, tcp")])).unwrap();
        let allowed = parse_transports(config.get("transports").unwrap()).unwrap();
        assert_eq!(allowed, [crate::TransportKind::Cma, crate::TransportKind::Tcp]);
        let error = Config::defaults().apply_env(env(&[("KVRING_TRANSPORTS", "shm,verbs")])).unwrap_err().to_string();
        assert!(error.contains("$KVRING_TRANSPORTS: transports: \"shm,verbs\" is not a list of transports"), "{error}");
    }
}
