//! The flag reference (docs/reference/flags.md), generated from the commands' own clap definitions so that
//! it cannot drift from `--help`: `gaps reference` prints it, and a test compares the checked-in file with
//! what the built binary prints.

use std::fmt::Write as _;

/// Markdown for `cmd` and every subcommand under it (depth first, in declaration order), one section per
/// command that takes flags or arguments: its description, then each flag with its value, environment
/// variable, default and possible values, and its whole help text.
pub fn flags_markdown(cmd: &clap::Command) -> String {
    // Built, clap settles each argument's value count and hands global flags down to the subcommands.
    let mut cmd = cmd.clone();
    cmd.build();
    let mut out = String::new();
    out.push_str(
        "# Flag reference\n\n\
         Every command's flags, generated from the programs' own definitions (`gaps reference > \
         docs/reference/flags.md`; a test fails when this file is not current). A flag with an `env` variable \
         can also be set by it, or in a `--config` TOML file (docs/guide/cluster.md, \"Configuration file\"); a \
         flag beats a variable, which beats the file. `gaps server` and `gaps worker` take the same flags as \
         the `gaps-server` and `gaps-worker` programs.\n",
    );
    section(&mut out, &cmd, &[]);
    out
}

fn section(out: &mut String, cmd: &clap::Command, parents: &[&str]) {
    if cmd.is_hide_set() || cmd.get_name() == "help" {
        return;
    }
    let mut path: Vec<&str> = parents.to_vec();
    path.push(cmd.get_name());
    // A global flag is written once, where it is declared.
    let args = visible_args(cmd, !parents.is_empty());
    if !args.is_empty() || parents.is_empty() {
        let _ = writeln!(out, "\n## `{}`\n", path.join(" "));
        if let Some(about) = cmd.get_long_about().or(cmd.get_about()) {
            let _ = writeln!(out, "{}\n", one_paragraph_per_block(&about.to_string()));
        }
        for arg in args {
            flag(out, arg);
        }
    }
    for sub in cmd.get_subcommands() {
        section(out, sub, &path);
    }
}

/// One flag as `--help` describes it: what the Markdown reference writes and `gaps reference --json` prints
/// (the Python launcher builds its shard flags from the latter, so that it declares none of them again).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Flag {
    /// The long name without its dashes (`lr`), or none for a positional argument.
    pub long: Option<String>,
    pub short: Option<char>,
    /// The value's name (`<LR>`), or none for a switch.
    pub value: Option<String>,
    pub required: bool,
    /// The whole help text, one paragraph per block.
    pub help: String,
    /// The environment variable that sets it.
    pub env: Option<String>,
    /// The default value(s), none for a switch.
    pub default: Vec<String>,
    /// The values it accepts, when clap knows them.
    pub possible: Vec<String>,
}

impl Flag {
    pub fn of(arg: &clap::Arg) -> Flag {
        let takes_value = arg.get_num_args().is_some_and(|n| n.takes_values())
            && !matches!(
                arg.get_action(),
                clap::ArgAction::SetTrue | clap::ArgAction::SetFalse | clap::ArgAction::Count
            );
        let value = arg
            .get_value_names()
            .map(|names| names.iter().map(|n| format!("<{n}>")).collect::<Vec<_>>().join(" "))
            .unwrap_or_else(|| format!("<{}>", arg.get_id().as_str().to_uppercase()));
        let help = arg.get_long_help().or(arg.get_help()).map(|h| h.to_string()).unwrap_or_default();
        Flag {
            long: arg.get_long().map(str::to_owned),
            short: arg.get_short(),
            value: (takes_value || arg.get_long().is_none()).then_some(value),
            env: arg.get_env().map(|e| e.to_string_lossy().into_owned()),
            default: if takes_value {
                arg.get_default_values().iter().map(|d| d.to_string_lossy().into_owned()).collect()
            } else {
                Vec::new()
            },
            possible: arg
                .get_possible_values()
                .iter()
                .filter(|p| !p.is_hide_set())
                .map(|p| p.get_name().to_owned())
                .collect(),
            required: arg.is_required_set(),
            help: paragraphs(&help),
        }
    }
}

/// The flags of the command at `path` under `cmd` (`["server"]` for `gaps server`), as `--help` lists them;
/// none when there is no such command.
pub fn flags_of(cmd: &clap::Command, path: &[String]) -> Option<Vec<Flag>> {
    let mut cmd = cmd.clone();
    cmd.build();
    let mut at = &cmd;
    for name in path {
        at = at.get_subcommands().find(|s| s.get_name() == name && !s.is_hide_set())?;
    }
    Some(visible_args(at, false).into_iter().map(Flag::of).collect())
}

fn visible_args(cmd: &clap::Command, skip_global: bool) -> Vec<&clap::Arg> {
    cmd.get_arguments()
        .filter(|a| !a.is_hide_set() && !matches!(a.get_id().as_str(), "help" | "version"))
        .filter(|a| !skip_global || !a.is_global_set())
        .collect()
}

fn flag(out: &mut String, arg: &clap::Arg) {
    let f = Flag::of(arg);
    let name = match (&f.long, f.short) {
        (Some(long), Some(short)) => format!("-{short}, --{long}"),
        (Some(long), None) => format!("--{long}"),
        (None, Some(short)) => format!("-{short}"),
        (None, None) => String::new(),
    };
    let head = match (name.is_empty(), &f.value) {
        (true, value) => value.clone().unwrap_or_default(),
        (false, Some(value)) => format!("{name} {value}"),
        (false, None) => name,
    };
    let mut facts = Vec::new();
    if let Some(env) = &f.env {
        facts.push(format!("env `{env}`"));
    }
    if !f.default.is_empty() {
        facts.push(format!("default `{}`", f.default.join(",")));
    }
    if !f.possible.is_empty() && f.possible.len() <= 24 {
        let possible: Vec<String> = f.possible.iter().map(|p| format!("`{p}`")).collect();
        facts.push(format!("one of {}", possible.join(", ")));
    }
    if f.required {
        facts.push("required".into());
    }
    let _ = write!(out, "- `{head}`");
    if !facts.is_empty() {
        let _ = write!(out, " ({})", facts.join("; "));
    }
    if f.help.is_empty() {
        out.push('\n');
    } else {
        let _ = writeln!(out, ": {}", escaped(&f.help).replace('\n', "\n  "));
    }
}

/// clap's help text with its line breaks inside paragraphs joined.
fn paragraphs(text: &str) -> String {
    text.trim()
        .split("\n\n")
        .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// clap's help text with its line breaks inside paragraphs joined (Markdown wraps them anyway), and `<`, `>`
/// outside code spans escaped (`shard-<i>.pem` would otherwise be read as an HTML tag).
fn one_paragraph_per_block(text: &str) -> String {
    escaped(&paragraphs(text))
}

/// `<` and `>` outside code spans escaped.
fn escaped(joined: &str) -> String {
    let mut out = String::with_capacity(joined.len());
    let mut in_code = false;
    for c in joined.chars() {
        match c {
            '`' => {
                in_code = !in_code;
                out.push(c);
            }
            '<' if !in_code => out.push_str("&lt;"),
            '>' if !in_code => out.push_str("&gt;"),
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, clap::Parser)]
    #[command(name = "demo")]
    /// A demo.
    struct Demo {
        /// How many (at most <N>, see `a <b>`).
        #[arg(long, env = "DEMO_N", default_value_t = 3)]
        n: u32,
        /// A switch.
        #[arg(long)]
        quiet: bool,
        #[command(subcommand)]
        sub: Option<Sub>,
    }

    #[derive(Debug, clap::Subcommand)]
    enum Sub {
        /// Go somewhere.
        Go {
            /// Where to.
            #[arg(long, value_parser = ["up", "down"])]
            to: String,
        },
    }

    // clap drops the full stop of a one-sentence help text.
    #[test]
    fn every_flag_is_written_with_its_variable_default_values_and_help() {
        let md = flags_markdown(&<Demo as clap::CommandFactory>::command());
        assert!(md.contains("\n## `demo`\n\nA demo\n"), "{md}");
        assert!(
            md.contains("- `--n <N>` (env `DEMO_N`; default `3`): How many (at most &lt;N&gt;, see `a <b>`)\n"),
            "{md}"
        );
        assert!(md.contains("- `--quiet`: A switch\n"), "{md}");
        assert!(md.contains("\n## `demo go`\n\nGo somewhere\n"), "{md}");
        assert!(md.contains("- `--to <TO>` (one of `up`, `down`; required): Where to\n"), "{md}");
        assert!(!md.contains("--help"), "{md}");
    }

    #[test]
    fn a_commands_flags_are_listed_with_their_facts_and_an_unknown_command_is_none() {
        let cmd = <Demo as clap::CommandFactory>::command();
        let top = flags_of(&cmd, &[]).expect("the top command");
        assert_eq!(
            top[0],
            Flag {
                long: Some("n".into()),
                short: None,
                value: Some("<N>".into()),
                env: Some("DEMO_N".into()),
                default: vec!["3".into()],
                possible: vec![],
                required: false,
                help: "How many (at most <N>, see `a <b>`)".into(),
            }
        );
        assert_eq!((top[1].long.as_deref(), top[1].value.as_deref()), (Some("quiet"), None), "a switch has no value");
        assert_eq!(top.len(), 2, "no --help: {top:?}");
        let go = flags_of(&cmd, &["go".to_owned()]).expect("demo go");
        assert_eq!((go[0].possible.clone(), go[0].required), (vec!["up".to_owned(), "down".to_owned()], true));
        assert!(flags_of(&cmd, &["stay".to_owned()]).is_none());
    }
}
