//! An overwriting copy by a group of ranks: every rank's files published together.
//!
//! Each rank stages its share (stage.rs; rank 0 its split files' uploads too, split.rs), so
//! nothing is visible yet. Publishing share by share, rank by rank, could leave two checkpoints
//! mixed: a rank's new shards beside another rank's earlier ones, under either index, loading
//! without an error. So the ranks go step by step, each step ending in an all-gather of every
//! rank's outcome ([`Exchange`]), and no rank takes a step before every rank has finished the one
//! before:
//!
//! 1. every rank has staged its share;
//! 2. rank 0 removes the earlier files the copy replaces (all ranks' destinations) and the stale
//!    ones of another layout, indexes last ([`stage::clear_earlier`]; one earlier file is replaced
//!    in one step, unless it is a weight file a new index would name before it is replaced);
//! 3. every rank publishes its indexes: from here on an index names shards not yet there, so a
//!    load raises rather than finding fewer shards;
//! 4. every rank publishes its other files (the weights, configs).
//!
//! A step that fails on any rank: every rank aborts what it has not published and removes what it
//! has (weights first), so the destination holds the earlier files (a failure before step 2) or
//! none. A rank that is gone (the exchange itself fails: killed, its link cut, Ctrl-C) cannot
//! clean up: the others then keep the indexes they published, which name the shards it may
//! have left, so that those never load as a smaller model; a load raises.

use super::split::{failure, Exchange, Stopped};
use super::stage::{self, File, Staged};
use super::CopyOptions;
use crate::error::{Error, Result};

/// Why the group stops at a step, as this rank learned it.
enum Halt {
    /// Another rank failed (its error is the group's).
    Stopped(Stopped),
    /// This rank failed; the others know.
    Failed(Error),
    /// The exchange failed: a rank may be gone.
    Lost(Error),
}

/// Ends a step: this rank's outcome to every rank, every rank's back; `Ok` when every rank did
/// its part.
fn settle(step: Result<()>, exchange: &Exchange) -> std::result::Result<(), Halt> {
    let message = match &step {
        Ok(()) => "ok".to_string(),
        Err(e) => format!("err:{e}"),
    };
    let all = match exchange(message) {
        Ok(all) => all,
        Err(lost) => return Err(Halt::Lost(step.err().unwrap_or(lost))),
    };
    match (step, failure(&all)) {
        (Err(e), _) => Err(Halt::Failed(e)),
        (Ok(()), Some(stopped)) => Err(Halt::Stopped(stopped)),
        (Ok(()), None) => Ok(()),
    }
}

/// The steps, in order.
enum Step {
    Staged,
    Cleared,
    Indexes,
    Others,
}

/// Publishes `staged`, this rank's share of a group's overwriting copy, with the other ranks (see
/// the module's documentation). `own`: how this rank's staging went (its error is returned once
/// the group heard of it). `all`: every destination of the copy, every rank's. `Ok(Err)`:
/// another rank failed, and this one undid its part.
pub(super) fn publish(
    staged: Staged,
    own: Result<()>,
    all: &[&str],
    options: &CopyOptions,
    exchange: &Exchange,
) -> Result<std::result::Result<(), Stopped>> {
    let write = &options.write;
    let (indexes, others): (Vec<File>, Vec<File>) = staged
        .into_files()
        .into_iter()
        .partition(|f| stage::is_index(&f.to));
    let mut rest: Vec<std::vec::IntoIter<File>> = vec![indexes.into_iter(), others.into_iter()];
    let mut published: Vec<String> = Vec::new();
    let mut own = Some(own);
    for step in [Step::Staged, Step::Cleared, Step::Indexes, Step::Others] {
        let done = match step {
            Step::Staged => own.take().unwrap_or(Ok(())),
            Step::Cleared if options.rank == 0 => {
                stage::clear_earlier(all, all, write, true).map(|_| ())
            }
            Step::Cleared => Ok(()),
            Step::Indexes => stage::publish_each(&mut rest[0], &mut published, options),
            Step::Others => stage::publish_each(&mut rest[1], &mut published, options),
        };
        let Err(halt) = settle(done, exchange) else {
            continue;
        };
        let unpublished: Vec<File> = rest.into_iter().flatten().collect();
        if let Halt::Lost(_) = halt {
            // The indexes stay: they name what a rank that is gone may have published.
            published.retain(|to| !stage::is_index(to));
        }
        stage::roll_back(unpublished, &published, write);
        return match halt {
            Halt::Stopped(stopped) => Ok(Err(stopped)),
            Halt::Failed(e) | Halt::Lost(e) => Err(e),
        };
    }
    Ok(Ok(()))
}
