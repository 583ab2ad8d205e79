//! The command line as a new user meets it: real processes of the built
//! binary for `--help`, `--version`, completions, and the errors of bad
//! flags, which name the flag, the value and what would do instead.

use std::process::{Command, Output};

fn kvring(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvring")).args(args).output().expect("kvring runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn every_command_help_lists_its_flags() {
    let cases: [(&[&str], &[&str]); 4] = [
        (&["--help"], &["bench", "serve", "info", "completions", "--version", "KVRING_"]),
        (
            &["bench", "--help"],
            &[
                "--op",
                "--block-size",
                "--total",
                "--transport",
                "--peer",
                "--peer-raw",
                "--duration",
                "--kv",
                "--report",
            ],
        ),
        (
            &["serve", "--help"],
            &["--config", "--name", "--listen", "--region-size", "--io-timeout", "--kv-blocks", "--raw-sink"],
        ),
        (&["info", "--help"], &["--json", "--config", "--metadata-ttl", "--token", "--lanes"]),
    ];
    for (args, flags) in cases {
        let output = kvring(args);
        assert!(output.status.success(), "{args:?}: {}", stderr(&output));
        let help = stdout(&output);
        for flag in flags {
            assert!(help.contains(flag), "{args:?} does not mention {flag}:\n{help}");
        }
    }
    // Bare `kvring` shows the help too, as a first step rather than an error.
    let output = kvring(&[]);
    assert!(output.status.success() && stdout(&output).contains("Usage: kvring"), "{}", stdout(&output));
}

#[test]
fn version_names_the_features_built() {
    let output = kvring(&["--version"]);
    assert!(output.status.success());
    let line = stdout(&output);
    let features: Vec<&str> =
        [("python", cfg!(feature = "python"))].into_iter().filter_map(|(name, on)| on.then_some(name)).collect();
    let features = if features.is_empty() { "none".to_string() } else { features.join(", ") };
    assert_eq!(line.trim(), format!("kvring {} (features: {features})", env!("CARGO_PKG_VERSION")));
}

#[test]
fn completions_print_a_shell_script() {
    let output = kvring(&["completions", "bash"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let script = stdout(&output);
    assert!(script.contains("_kvring") && script.contains("complete") && script.contains("--block-size"), "{script}");
    for shell in ["zsh", "fish"] {
        let output = kvring(&["completions", shell]);
        assert!(output.status.success() && !output.stdout.is_empty(), "{shell}: {}", stderr(&output));
    }
    assert!(!kvring(&["completions", "cmd.exe"]).status.success());
}

#[test]
fn a_bad_size_names_the_flag_the_value_and_the_units() {
    let output = kvring(&["bench", "--block-size", "3XB"]);
    assert!(!output.status.success());
    let error = stderr(&output);
    for part in ["--block-size", "3XB", "KiB", "MiB", "GiB", "GB", "10^9"] {
        assert!(error.contains(part), "{part} missing in {error}");
    }
}

#[test]
fn a_bad_transport_lists_the_transports_of_this_build() {
    let output = kvring(&["bench", "--transport", "carrier-pigeon"]);
    assert!(!output.status.success());
    let error = stderr(&output);
    let expected = "shm, cuda_ipc, cma, tcp, null, rdma]";
    assert!(error.contains("--transport") && error.contains("carrier-pigeon") && error.contains(expected), "{error}");
    // `info` lists the same ones.
    let info = stdout(&kvring(&["info"]));
    assert!(info.contains(&format!("transports:       {}", expected.trim_end_matches(']'))), "{info}");
}

#[test]
fn a_gigabyte_is_ten_to_the_ninth_bytes() {
    // The header states the total per case as given; a tiny region and
    // one small case keep this quick (1GB moves over a 1MiB region).
    let output = kvring(&[
        "bench",
        "--total",
        "1GB",
        "--block-size",
        "1MiB",
        "--op",
        "write",
        "--region-size",
        "1MiB",
        "--latency-samples",
        "0",
        "--transport",
        "null",
    ]);
    let text = stdout(&output);
    assert!(output.status.success(), "{}\n{text}", stderr(&output));
    let header = text.lines().next().unwrap();
    assert!(header.contains("1GB per case") && header.contains("1 lane ("), "{header}");
}

/// `kvring info` has one line for GPUs: each one the driver lists, or why
/// there are none; one for the NICs each GPU's memory would go over; the
/// JSON form carries the same.
#[test]
fn info_lists_the_gpus_or_says_why_there_are_none() {
    let output = kvring(&["info"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    let line = text.lines().find(|l| l.starts_with("gpus:")).unwrap_or_else(|| panic!("no gpus line:\n{text}"));
    let json: serde_json::Value = serde_json::from_slice(&kvring(&["info", "--json"]).stdout).unwrap();
    let gpus = &json["gpus"];
    match kvring::host::gpus() {
        Ok(devices) => {
            // A GPU host: every device, with its memory and NUMA node.
            assert!(devices.iter().all(|d| line.contains(d.as_str())), "{line}");
            assert!(line.contains("MiB") && line.contains("numa"), "{line}");
            assert_eq!(gpus["devices"].as_array().map(Vec::len), Some(devices.len()), "{gpus}");
        }
        Err(reason) => {
            // No driver here: the line says so, and says why.
            assert!(line.contains("none: ") && line.contains("no CUDA driver found"), "{line}");
            assert!(line.contains(&reason), "{line} vs {reason}");
            assert!(gpus["devices"].is_null() && gpus["reason"].as_str() == Some(reason.as_str()), "{gpus}");
        }
    }
    // Which NICs each GPU's memory would go over, and why; or why none.
    let line = text.lines().find(|l| l.starts_with("gpu nics:")).unwrap_or_else(|| panic!("no gpu nics line:\n{text}"));
    let choices = &json["gpu_nics"];
    match kvring::host::gpu_nics() {
        Ok(lines) => {
            assert!(lines.iter().all(|l| line.contains(l.as_str()) && l.contains(" -> ")), "{line}");
            assert_eq!(choices["choices"].as_array().map(Vec::len), Some(lines.len()), "{choices}");
        }
        Err(reason) => {
            assert!(line.contains("none: ") && line.contains(&reason), "{line} vs {reason}");
            assert_eq!(choices["reason"].as_str(), Some(reason.as_str()), "{choices}");
        }
    }
}
