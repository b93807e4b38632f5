//! `--config FILE`: settings from a TOML file for every binary, below flags and `GAPS_*` variables.
//!
//! The file holds flag names as keys (`shard-index` or `shard_index`) and their values (strings, numbers,
//! booleans for switches, arrays for repeatable flags). Top-level keys are shared: each command takes those
//! that are its flags and reports the others on stderr as ignored (a file for a whole cluster names
//! `listen` for the shards and `data` for the workers). A table named after a command — `[server]`,
//! `[worker]`, `[local]`, `[bench.transport]` — holds keys for that command only; there an unknown key is
//! an error, so a typo cannot pass unnoticed. Tables of other commands are skipped.
//!
//! Precedence, highest first: a flag on the command line, its `GAPS_*` variable, the command's table, the
//! top level, the built-in default. The file's values are handed to clap as flags after the command line's,
//! so they are parsed and checked exactly as typed flags are.

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Command};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The id of the `--config` argument every binary declares (global, so it may follow a subcommand).
pub const CONFIG_ARG: &str = "config";

/// What applying a file gave: the argument vector to parse and the notes to print (keys ignored).
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    /// The command line with the file's settings appended as flags.
    pub argv: Vec<OsString>,
    /// Top-level keys the running command has no flag for.
    pub ignored: Vec<String>,
}

/// Extends `argv` (already parsed by `cmd` into `matches`) with the settings of the file that `--config`
/// names, if any. Errors name the file and the key.
pub fn apply(cmd: &Command, matches: &ArgMatches, argv: &[OsString]) -> Result<Applied, String> {
    let mut out = Applied { argv: argv.to_vec(), ignored: Vec::new() };
    let Some(path) = config_path(matches) else { return Ok(out) };
    let text = std::fs::read_to_string(&path).map_err(|e| format!("reading config file {}: {e}", path.display()))?;
    let table: toml::Table =
        text.parse().map_err(|e| format!("config file {} is not valid TOML: {e}", path.display()))?;
    // The command that runs: the leaf of the subcommand chain, and its name path (`bench.transport`).
    let (mut leaf_cmd, mut leaf, mut names) = (cmd, matches, Vec::new());
    while let Some((name, sub)) = leaf.subcommand() {
        leaf_cmd = leaf_cmd.find_subcommand(name).ok_or_else(|| format!("unknown subcommand {name}"))?;
        names.push(name.to_string());
        leaf = sub;
    }
    let own_name =
        if names.is_empty() { cmd.get_name().trim_start_matches("gaps-").to_string() } else { names.join(".") };
    let mut flags = Vec::new();
    // The command's own table (dotted names are nested tables in TOML).
    let mut own: Option<&toml::Table> = Some(&table);
    for part in own_name.split('.') {
        own = own.and_then(|t| t.get(part)).and_then(toml::Value::as_table);
    }
    let mut settings: Vec<(String, &toml::Value, bool)> = Vec::new();
    for (key, value) in &table {
        if !value.is_table() {
            settings.push((key.clone(), value, false));
        }
    }
    if let Some(own) = own {
        for (key, value) in own {
            if value.is_table() {
                return Err(format!("config file {}: [{own_name}] holds a table {key:?}", path.display()));
            }
            // The command's table outranks the top level: it replaces a shared key of the same name.
            let name = normalize(key);
            settings.retain(|(k, _, _)| normalize(k) != name);
            settings.push((key.clone(), value, true));
        }
    }
    for (key, value, strict) in settings {
        let name = normalize(&key);
        if name == CONFIG_ARG {
            return Err(format!("config file {}: a config file cannot name another one", path.display()));
        }
        let Some(arg) = leaf_cmd.get_arguments().find(|a| a.get_long() == Some(name.as_str())) else {
            if strict {
                return Err(format!(
                    "config file {}: [{own_name}] has an unknown key {key:?} (the flags of `{}` are its keys)",
                    path.display(),
                    own_name.replace('.', " ")
                ));
            }
            out.ignored.push(key);
            continue;
        };
        let id = arg.get_id().as_str();
        if matches!(leaf.value_source(id), Some(ValueSource::CommandLine | ValueSource::EnvVariable)) {
            continue;
        }
        let switch = matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse);
        let values: Vec<&toml::Value> = match value {
            toml::Value::Array(items) => items.iter().collect(),
            one => vec![one],
        };
        if values.len() > 1 && !matches!(arg.get_action(), ArgAction::Append) {
            return Err(format!("config file {}: {key:?} takes one value, not a list", path.display()));
        }
        for v in values {
            let text = match v {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Boolean(b) if switch => {
                    if *b {
                        flags.push(OsString::from(format!("--{name}")));
                    }
                    continue;
                }
                toml::Value::Boolean(b) => b.to_string(),
                other => {
                    return Err(format!(
                        "config file {}: {key:?} must be a string, number or boolean, not {}",
                        path.display(),
                        other.type_str()
                    ))
                }
            };
            if switch {
                return Err(format!("config file {}: {key:?} is a switch: write true or false", path.display()));
            }
            flags.push(OsString::from(format!("--{name}={text}")));
        }
    }
    // After the command line's flags, before a `--` that ends them.
    let at = out.argv.iter().position(|a| a == "--").unwrap_or(out.argv.len());
    out.argv.splice(at..at, flags);
    Ok(out)
}

/// `snake_case` keys name the same flags as `kebab-case` ones.
fn normalize(key: &str) -> String {
    key.trim().replace('_', "-")
}

/// The file `--config` (or `GAPS_CONFIG`) names, from the innermost subcommand that has it.
fn config_path(matches: &ArgMatches) -> Option<PathBuf> {
    let mut found = None;
    let mut m = Some(matches);
    while let Some(cur) = m {
        if let Ok(Some(p)) = cur.try_get_one::<PathBuf>(CONFIG_ARG) {
            found = Some(p.clone());
        }
        m = cur.subcommand().map(|(_, sub)| sub);
    }
    found
}

/// Parses the process's command line with `cmd`, applying `--config`: clap's own errors exit as clap
/// does; a bad file exits with status 2 and a message naming it. Returns the final matches.
pub fn parse_args(cmd: Command) -> ArgMatches {
    let argv: Vec<OsString> = std::env::args_os().collect();
    parse_from(cmd, &argv).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2)
    })
}

/// [`parse_args`] on an explicit argument vector (for tests); clap's errors (and `--help`) exit the process.
pub fn parse_from(cmd: Command, argv: &[OsString]) -> Result<ArgMatches, String> {
    // A first, lenient pass finds the subcommand, `--config` and what the command line and environment
    // set; flags the file is to supply may be missing from it.
    let Ok(first) = cmd.clone().ignore_errors(true).try_get_matches_from(argv) else {
        return Ok(cmd.get_matches_from(argv));
    };
    let applied = apply(&cmd, &first, argv)?;
    for key in &applied.ignored {
        eprintln!("note: the config file's key {key:?} is not a flag of this command; ignored");
    }
    match cmd.try_get_matches_from(&applied.argv) {
        Ok(m) => Ok(m),
        Err(e) if applied.argv.len() == argv.len() || !e.use_stderr() => e.exit(),
        Err(e) => {
            let path = config_path(&first).unwrap_or_default();
            let rendered = e.render().to_string();
            let message = rendered.trim_end().trim_start_matches("error: ");
            Err(format!("with config file {}: {message}", Path::new(&path).display()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction, Command};

    fn cli() -> Command {
        let config = Arg::new(CONFIG_ARG).long(CONFIG_ARG).global(true).value_parser(clap::value_parser!(PathBuf));
        let run = Command::new("run")
            .arg(Arg::new("steps").long("steps").default_value("10").value_parser(clap::value_parser!(u32)))
            .arg(Arg::new("shard-index").long("shard-index"))
            .arg(Arg::new("json").long("json").action(ArgAction::SetTrue))
            .arg(Arg::new("straggler").long("straggler").action(ArgAction::Append));
        let nested = Command::new("bench").subcommand(Command::new("transport").arg(Arg::new("only").long("only")));
        Command::new("gaps").arg(config).subcommand(run).subcommand(nested)
    }

    fn parse(file: &str, args: &[&str]) -> Result<ArgMatches, String> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("gaps-config-test-{}-{n}.toml", std::process::id()));
        std::fs::write(&path, file).expect("write the file");
        let mut argv: Vec<OsString> = vec!["gaps".into()];
        argv.extend(args.iter().map(OsString::from));
        argv.push(format!("--config={}", path.display()).into());
        let out = parse_from(cli(), &argv);
        let _ = std::fs::remove_file(&path);
        out
    }

    fn run_matches(m: &ArgMatches) -> &ArgMatches {
        m.subcommand_matches("run").expect("the run subcommand")
    }

    #[test]
    fn a_commands_table_outranks_the_top_level_and_flags_outrank_both() {
        let file = "steps = 5\nshard_index = \"3\"\nlisten = \"0.0.0.0:1\"\n[run]\nsteps = 7\njson = true\nstraggler = [\"1:4\", \"2:3\"]\n";
        let m = parse(file, &["run"]).expect("parses");
        let r = run_matches(&m);
        assert_eq!(r.get_one::<u32>("steps"), Some(&7), "[run] outranks the top level");
        assert_eq!(r.get_one::<String>("shard-index").map(String::as_str), Some("3"), "snake_case keys work");
        assert!(r.get_flag("json"));
        let stragglers: Vec<&String> = r.get_many::<String>("straggler").expect("a list").collect();
        assert_eq!(stragglers, ["1:4", "2:3"]);
        let m = parse(file, &["run", "--steps", "9"]).expect("parses");
        assert_eq!(run_matches(&m).get_one::<u32>("steps"), Some(&9), "a flag outranks the file");
        let m = parse("steps = 5\n", &["run"]).expect("parses");
        assert_eq!(run_matches(&m).get_one::<u32>("steps"), Some(&5), "the top level outranks the default");
        let m = parse("[run]\njson = false\n", &["run"]).expect("parses");
        assert!(!run_matches(&m).get_flag("json"));
        let m =
            parse("[bench.transport]\nonly = \"1Mi\"\n[run]\nsteps = 1\n", &["bench", "transport"]).expect("parses");
        let t = m.subcommand_matches("bench").and_then(|b| b.subcommand_matches("transport")).expect("transport");
        assert_eq!(t.get_one::<String>("only").map(String::as_str), Some("1Mi"), "nested tables name subcommands");
    }

    #[test]
    fn bad_files_are_refused_with_the_file_and_the_key_named() {
        let unknown = parse("[run]\nstepz = 3\n", &["run"]).expect_err("unknown key");
        assert!(unknown.contains("stepz") && unknown.contains("gaps-config-test"), "{unknown}");
        let bad_value = parse("[run]\nsteps = \"many\"\n", &["run"]).expect_err("bad value");
        assert!(bad_value.contains("--steps") && bad_value.contains("many"), "{bad_value}");
        assert!(parse("steps = \n", &["run"]).expect_err("bad TOML").contains("not valid TOML"));
        assert!(parse("[run]\nsteps = [1, 2]\n", &["run"]).expect_err("a list").contains("one value"));
        assert!(parse("[run]\njson = \"yes\"\n", &["run"]).expect_err("a switch").contains("switch"));
        assert!(parse("[run]\nsteps = { a = 1 }\n", &["run"]).expect_err("a table").contains("table"));
        assert!(parse("[run]\nconfig = \"x.toml\"\n", &["run"]).expect_err("recursion").contains("another"));
        let dir = std::env::temp_dir().join(format!("gaps-config-missing-{}", std::process::id()));
        let argv: Vec<OsString> =
            vec!["gaps".into(), "run".into(), format!("--config={}", dir.join("none.toml").display()).into()];
        assert!(parse_from(cli(), &argv).expect_err("a missing file").contains("reading config file"));
        // Top-level keys another command uses are skipped, not refused (one file serves a whole cluster).
        assert!(parse("data = \"x.csv\"\n", &["run"]).is_ok());
    }
}
