//! The address an engine tells peers (in handshakes and in the metadata
//! store) when it listens on an unspecified one.
//!
//! The order, first match wins:
//! 1. the `advertise` setting (`--advertise`, `KVRING_ADVERTISE`, config);
//! 2. the listen address itself, when it is a concrete one;
//! 3. `KVRING_HOST_IP`, `HOST_IP`, `POD_IP` (as Kubernetes sets them);
//! 4. the address of the interface that routes to the metadata server (or
//!    the first peer), found with a connected UDP socket (no packet sent);
//! 5. the hostname's address, preferring a non-loopback one.
//!
//! A variable that is not an IP address, or a hostname that does not
//! resolve, is an error; so is a hostname that resolves only to loopback:
//! kvring never silently advertises 127.0.0.1 for a wildcard listener.

use crate::error::{Error, Result};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};

/// Environment variables consulted, in order.
pub const ADDRESS_VARIABLES: [&str; 3] = ["KVRING_HOST_IP", "HOST_IP", "POD_IP"];

/// The chosen address and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advertised {
    /// The address peers are told.
    pub ip: IpAddr,
    /// Which rule chose it, for `kvring info`.
    pub source: String,
}

/// What the resolution may look at; [`Inputs::from_process`] fills it from
/// this process, tests fill it by hand.
pub struct Inputs<'a> {
    /// The `advertise` setting.
    pub configured: Option<IpAddr>,
    /// The IP the engine listens on.
    pub listen: IpAddr,
    /// Looks an environment variable up.
    pub env: &'a dyn Fn(&str) -> Option<String>,
    /// `host:port` of the metadata server or first peer, if known.
    pub route_to: Option<&'a str>,
    /// This host's name, if it has one.
    pub hostname: Option<String>,
}

impl std::fmt::Debug for Inputs<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inputs")
            .field("configured", &self.configured)
            .field("listen", &self.listen)
            .field("route_to", &self.route_to)
            .field("hostname", &self.hostname)
            .finish()
    }
}

impl<'a> Inputs<'a> {
    /// The inputs of this process.
    pub fn from_process(
        configured: Option<IpAddr>,
        listen: IpAddr,
        env: &'a dyn Fn(&str) -> Option<String>,
        route_to: Option<&'a str>,
    ) -> Self {
        Self { configured, listen, env, route_to, hostname: hostname() }
    }
}

/// The address an engine advertises, given its `advertise` setting, the IP
/// it listens on and its metadata server (if any): [`resolve`] with this
/// process's environment and hostname. The engine and `kvring info` (through
/// `EngineBuilder::planned_advertise`) both call this.
pub(crate) fn for_process(configured: Option<IpAddr>, listen: IpAddr, route_to: Option<&str>) -> Result<Advertised> {
    let env = |name: &str| std::env::var(name).ok();
    resolve(&Inputs::from_process(configured, listen, &env, route_to))
}

/// Resolves the advertised address in the documented order.
pub fn resolve(inputs: &Inputs<'_>) -> Result<Advertised> {
    let found = |ip: IpAddr, source: String| Ok(Advertised { ip, source });
    if let Some(ip) = inputs.configured {
        return found(ip, "advertise setting".into());
    }
    if !inputs.listen.is_unspecified() {
        return found(inputs.listen, "listen address".into());
    }
    for var in ADDRESS_VARIABLES {
        if let Some(value) = (inputs.env)(var).filter(|v| !v.trim().is_empty()) {
            let ip: IpAddr = value
                .trim()
                .parse()
                .map_err(|_| Error::invalid("advertised address", format!("${var}={value:?} is not an IP address")))?;
            return found(ip, format!("${var}"));
        }
    }
    if let Some(target) = inputs.route_to {
        if let Some(ip) = route_source(target) {
            return found(ip, format!("interface routing to {target}"));
        }
    }
    let Some(name) = &inputs.hostname else {
        return Err(Error::invalid("advertised address", "no advertise setting, variable, route or hostname to use"));
    };
    let addrs: Vec<IpAddr> = (name.as_str(), 0)
        .to_socket_addrs()
        .map_err(|e| {
            Error::invalid(
                "advertised address",
                format!("the hostname {name:?} does not resolve ({e}); set --advertise or $KVRING_HOST_IP"),
            )
        })?
        .map(|a| a.ip())
        .collect();
    match addrs.iter().find(|ip| !ip.is_loopback()).or(addrs.first()) {
        Some(ip) if !ip.is_loopback() => found(*ip, format!("hostname {name}")),
        _ => Err(Error::invalid(
            "advertised address",
            format!("the hostname {name:?} resolves only to loopback; set --advertise or $KVRING_HOST_IP"),
        )),
    }
}

/// The local address a datagram to `target` would leave from.
fn route_source(target: &str) -> Option<IpAddr> {
    let target: SocketAddr = target.to_socket_addrs().ok()?.next()?;
    let bind: SocketAddr = if target.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().ok()?;
    let socket = UdpSocket::bind(bind).ok()?;
    socket.connect(target).ok()?;
    Some(socket.local_addr().ok()?.ip()).filter(|ip| !ip.is_unspecified())
}

/// This host's name.
pub fn hostname() -> Option<String> {
    let mut buffer = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer we own.
    let rc = unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len()) };
    if rc != 0 {
        return None;
    }
    let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
    String::from_utf8(buffer[..end].to_vec()).ok().filter(|name| !name.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve_with(
        configured: Option<&str>,
        listen: &str,
        vars: &[(&str, &str)],
        route: Option<&str>,
        host: Option<&str>,
    ) -> Result<Advertised> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let env = move |name: &str| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        resolve(&Inputs {
            configured: configured.map(|ip| ip.parse().unwrap()),
            listen: listen.parse().unwrap(),
            env: &env,
            route_to: route,
            hostname: host.map(str::to_string),
        })
    }

    #[test]
    fn each_rule_in_order() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let all = [("KVRING_HOST_IP", "10.0.0.1"), ("HOST_IP", "10.0.0.2"), ("POD_IP", "10.0.0.3")];
        let got = resolve_with(Some("10.9.9.9"), "0.0.0.0", &all, None, None).unwrap();
        assert_eq!(got, Advertised { ip: ip("10.9.9.9"), source: "advertise setting".into() });
        let got = resolve_with(None, "192.168.1.5", &all, None, None).unwrap();
        assert_eq!(got, Advertised { ip: ip("192.168.1.5"), source: "listen address".into() });
        assert_eq!(resolve_with(None, "0.0.0.0", &all, None, None).unwrap().source, "$KVRING_HOST_IP");
        assert_eq!(resolve_with(None, "0.0.0.0", &all[1..], None, None).unwrap().ip, ip("10.0.0.2"));
        assert_eq!(resolve_with(None, "0.0.0.0", &all[2..], None, None).unwrap().source, "$POD_IP");
        let routed = resolve_with(None, "0.0.0.0", &[], Some("127.0.0.1:2379"), Some("ignored")).unwrap();
        assert_eq!(routed, Advertised { ip: ip("127.0.0.1"), source: "interface routing to 127.0.0.1:2379".into() });
    }

    #[test]
    fn bad_variables_and_hostnames_are_errors_never_a_silent_loopback() {
        let error = resolve_with(None, "0.0.0.0", &[("HOST_IP", "not-an-ip")], None, None).unwrap_err();
        assert!(error.to_string().contains("$HOST_IP=\"not-an-ip\" is not an IP address"), "{error}");
        let error = resolve_with(None, "0.0.0.0", &[], None, Some("no-such-host.invalid")).unwrap_err();
        assert!(error.to_string().contains("does not resolve"), "{error}");
        let error = resolve_with(None, "0.0.0.0", &[], None, Some("localhost")).unwrap_err();
        assert!(error.to_string().contains("resolves only to loopback"), "{error}");
        let error = resolve_with(None, "0.0.0.0", &[], None, None).unwrap_err();
        assert!(error.to_string().contains("no advertise setting"), "{error}");
    }
}
