//! How each front end names an argument: Python's keyword, the command line's flag, the
//! environment variable that stands in for it. A leaf below `error` (whose messages name
//! arguments per front end) and `options` (whose table of options has a row here for each).

/// The variables that stand in for a load's options when the caller leaves them out.
pub const ENV_CONCURRENCY: &str = "FASTLOAD_CONCURRENCY";
pub const ENV_BLOCK_SIZE: &str = "FASTLOAD_BLOCK_SIZE";
pub const ENV_MEMORY_LIMIT: &str = "FASTLOAD_MEMORY_LIMIT";
pub const ENV_METHOD: &str = "FASTLOAD_METHOD";
pub const ENV_COPY_STREAMS: &str = "FASTLOAD_COPY_STREAMS";
pub const ENV_CACHE: &str = "FASTLOAD_CACHE";
pub const ENV_VERIFY: &str = "FASTLOAD_VERIFY";
pub const ENV_KEYSET: &str = "FASTLOAD_KEYSET";

/// Which front end shows a message: Python names an argument by its keyword (`overwrite=True`),
/// the command line by its flag (`--overwrite`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrontEnd {
    Python,
    Cli,
}

/// How each front end names one argument. Errors carry the argument's identity (`option`); each
/// front end renders it where the message is shown (`src/python/errors.rs`, `src/cli.rs`,
/// through `Error::message_for`), from this table.
#[derive(Clone, Copy, Debug)]
pub struct Argument {
    /// Its identity, as errors carry it (and `ConfigError.option` unless `python` differs).
    pub option: &'static str,
    /// Python's keyword for it.
    pub python: &'static str,
    /// A yes/no argument: a Python message asks for `overwrite=True`, not `keyset=`.
    pub switch: bool,
    /// The command line's flag, and how a message asks for it (`--keyset FILE`); `None`: the
    /// command line has no such argument.
    pub cli: Option<(&'static str, &'static str)>,
    /// The environment variable that stands in for it when it is not given.
    pub env: Option<&'static str>,
    /// The values it takes, checked by `options::check` whichever front end gave it.
    pub accepts: Accepts,
}

/// The values of a numeric argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accepts {
    /// What its type takes (checked where it is read, if at all).
    Any,
    /// A count in `min..=max`.
    Count(u64, u64),
    /// A byte count in `min..=max`.
    Bytes(u64, u64),
}

/// The smallest upload part the object stores take (but for a file's last part), and the
/// largest (S3's limits; GCS's XML API and Azure's blocks take them too).
pub const MIN_PART_SIZE: u64 = 5 << 20;
pub const MAX_PART_SIZE: u64 = 5 << 30;

/// A load's option (a row of `options::OPTIONS`, named alike in Python and in errors) with
/// its environment variable and its command-line flag (`None`: Python only).
const fn load_option(
    name: &'static str,
    env: Option<&'static str>,
    cli: Option<(&'static str, &'static str)>,
    accepts: Accepts,
) -> Argument {
    Argument {
        option: name,
        python: name,
        switch: false,
        cli,
        env,
        accepts,
    }
}

/// Every argument a message may name, and how each front end names it: the one table of both
/// names (`cargo test options` checks that every option of `options::OPTIONS` has its row, with
/// its name and variable, and that the flags are the command line's).
pub const ARGUMENTS: &[Argument] = &[
    load_option(
        "device",
        None,
        Some(("--device", "--device DEVICE")),
        Accepts::Any,
    ),
    load_option(
        "concurrency",
        Some(ENV_CONCURRENCY),
        Some(("--concurrency", "--concurrency N")),
        Accepts::Count(1, 4096),
    ),
    load_option(
        "block_size",
        Some(ENV_BLOCK_SIZE),
        Some(("--block-size", "--block-size SIZE")),
        Accepts::Bytes(4096, 1 << 30),
    ),
    load_option(
        "memory_limit",
        Some(ENV_MEMORY_LIMIT),
        Some(("--memory-limit", "--memory-limit SIZE")),
        Accepts::Bytes(1 << 20, u64::MAX),
    ),
    load_option("names", None, None, Accepts::Any),
    load_option("parts", None, None, Accepts::Any),
    load_option(
        "method",
        Some(ENV_METHOD),
        Some(("--method", "--method METHOD")),
        Accepts::Any,
    ),
    load_option(
        "copy_streams",
        Some(ENV_COPY_STREAMS),
        Some(("--copy-streams", "--copy-streams N")),
        Accepts::Count(1, 16),
    ),
    load_option(
        "storage_options",
        None,
        Some(("--option", "--option KEY=VALUE")),
        Accepts::Any,
    ),
    load_option(
        "cache",
        Some(ENV_CACHE),
        Some(("--cache", "--cache DIR")),
        Accepts::Any,
    ),
    // `fastload copy --no-verify` turns copy's check off; no command turns a load's on.
    load_option("verify", Some(ENV_VERIFY), None, Accepts::Any),
    load_option(
        "keyset",
        Some(ENV_KEYSET),
        Some(("--keyset", "--keyset FILE")),
        Accepts::Any,
    ),
    load_option("associated_data", None, None, Accepts::Any),
    load_option(
        "peers",
        Some("FASTLOAD_PEERS"),
        Some(("--peers", "--peers HOST:PORT,...")),
        Accepts::Any,
    ),
    load_option(
        "peer_token",
        Some("FASTLOAD_PEER_TOKEN"),
        None,
        Accepts::Any,
    ),
    Argument {
        option: "overwrite",
        python: "overwrite",
        switch: true,
        cli: Some(("--overwrite", "--overwrite")),
        env: None,
        accepts: Accepts::Any,
    },
    // A write's upload parts (`save_file`, `save`, `copy`, `fastload copy`).
    Argument {
        option: "part_size",
        python: "part_size",
        switch: false,
        cli: Some(("--part-size", "--part-size SIZE")),
        env: None,
        accepts: Accepts::Bytes(MIN_PART_SIZE, MAX_PART_SIZE),
    },
    // The keyset a write encrypts with: Python's `keyset=` of `save_file`, `save` and `copy`;
    // `fastload copy --encrypt` (with `--keyset FILE`, else `FASTLOAD_KEYSET`).
    Argument {
        option: "encrypt",
        python: "keyset",
        switch: false,
        cli: Some(("--encrypt", "--encrypt")),
        env: None,
        accepts: Accepts::Any,
    },
];

impl Argument {
    /// How a Python message asks for it: `keyset=`, `overwrite=True`.
    fn python_given(&self) -> String {
        match self.switch {
            true => format!("{}=True", self.python),
            false => format!("{}=", self.python),
        }
    }
}

/// The row of `option`, if it has one.
pub fn argument(option: &str) -> Option<&'static Argument> {
    ARGUMENTS.iter().find(|a| a.option == option)
}

impl FrontEnd {
    /// How this front end names `option`: an argument's identity (`block_size`, or
    /// `--block-size`), a storage option (`storage_options["endpoint"]`, or `--option endpoint`),
    /// or anything else (an environment variable) as it is.
    pub fn name(self, option: &str) -> String {
        let key = option
            .strip_prefix("storage_options[")
            .and_then(|k| k.strip_suffix(']'));
        match (self, argument(option), key) {
            (FrontEnd::Python, Some(a), _) => a.python.to_string(),
            (
                FrontEnd::Cli,
                Some(Argument {
                    cli: Some((flag, _)),
                    ..
                }),
                _,
            ) => flag.to_string(),
            (FrontEnd::Cli, _, Some(key)) => {
                format!("--option {}", key.trim_matches('"'))
            }
            _ => option.to_string(),
        }
    }

    /// How this front end asks for `option` to be given, with the variable that stands in for
    /// it: `keyset= (or set FASTLOAD_KEYSET)`, `--keyset FILE (or set FASTLOAD_KEYSET)`,
    /// `overwrite=True`, `--overwrite`.
    pub fn given(self, option: &str) -> String {
        let Some(a) = argument(option) else {
            return option.to_string();
        };
        let given = match (self, a.cli) {
            (FrontEnd::Cli, Some((_, given))) => given.to_string(),
            _ => a.python_given(),
        };
        match a.env {
            Some(env) => format!("{given} (or set {env})"),
            None => given.to_string(),
        }
    }

    /// How this front end names `option` as left out: `keyset=`, `--encrypt`.
    pub fn without(self, option: &str) -> String {
        match (self, argument(option)) {
            (
                FrontEnd::Cli,
                Some(Argument {
                    cli: Some((_, given)),
                    ..
                }),
            ) => given.to_string(),
            (_, Some(a)) => format!("{}=", a.python),
            (_, None) => option.to_string(),
        }
    }
}
