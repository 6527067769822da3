//! A copy by a group of ranks that talk through an [`Exchange`]: they agree on the files to
//! split into parts, copy those together (split.rs) and the others each its share; an
//! overwriting copy publishes together (together.rs), a resuming one has rank 0 copy the indexes
//! first.

use std::sync::atomic::AtomicBool;
use std::sync::Mutex;

use super::{
    abort, run, split, stage, start, tally, together, whole, CopyOptions, Planned, Report,
};
use super::{Exchange, Item};
use crate::error::{Error, Result};

/// A copy by a group whose ranks talk through `exchange`: the ranks agree on the files to split,
/// copy those together and the others each its share; overwriting (`staged`), they publish
/// together (together.rs). Resuming, rank 0 copies the indexes before the ranks agree (their
/// first exchange), so that none publishes a shard before them: a group stopped at any point
/// leaves an index naming shards not yet there (a load raises), never shards alone.
pub(super) fn in_group(
    planned: Planned,
    options: &CopyOptions,
    exchange: &Exchange,
    staged: Option<stage::Staged>,
) -> Result<Report> {
    let mut report = Report::default();
    let (planned, ahead) = match staged {
        None if options.rank == 0 => indexes_ahead(planned, options),
        _ => (planned, Vec::new()),
    };
    let plan = match &planned {
        Ok((targets, split)) => Ok(split
            .iter()
            .map(|&i| (targets[i].1.clone(), targets[i].0.source.size()))
            .collect()),
        Err(e) => Err(e.to_string()),
    };
    let agreed = split::agree(plan, exchange)?;
    let (targets, split) = planned?;
    match agreed {
        Err(split::Stopped(s)) => {
            report.stopped = Some(s);
            return Ok(report);
        }
        Ok(false) => {
            return Err(Error::Internal {
                message: "the ranks of the copy listed different files to split (did the \
                          source change while they listed it?); nothing was copied"
                    .into(),
            })
        }
        Ok(true) => {}
    }
    start(&targets, &split, options);
    let files: Vec<&(Item, String)> = split.iter().map(|&i| &targets[i]).collect();
    let stop = AtomicBool::new(false);
    let parts = split::run(
        &files,
        options,
        exchange,
        &stop,
        &mut report,
        staged.as_ref(),
    );
    let outcomes = match (parts, staged) {
        (Err(e), staged) => {
            abort(staged);
            return Err(e);
        }
        (Ok(Err(split::Stopped(s))), staged) => {
            abort(staged);
            report.stopped = Some(s);
            return Ok(report);
        }
        (Ok(Ok(())), None) => whole(&targets, &split, options, None)?,
        (Ok(Ok(())), Some(staged)) => {
            // This rank's failure is the group's to hear of before it is returned.
            let (outcomes, own) = match whole(&targets, &split, options, Some(&staged)) {
                Ok(outcomes) => (outcomes, Ok(())),
                Err(e) => (Vec::new(), Err(e)),
            };
            let all: Vec<&str> = targets.iter().map(|(_, to)| to.as_str()).collect();
            if let Err(split::Stopped(s)) = together::publish(staged, own, &all, options, exchange)?
            {
                report.stopped = Some(s);
                return Ok(report);
            }
            outcomes
        }
    };
    let outcomes: Vec<Option<bool>> = match ahead.is_empty() {
        true => outcomes,
        false => outcomes.iter().zip(&ahead).map(|(o, a)| o.or(*a)).collect(),
    };
    Ok(tally(&targets, &outcomes, report))
}

/// The files a resuming group's rank 0 copies ahead of the others' ([`in_group`]): the indexes.
pub(super) fn ahead_of_group(targets: &[(Item, String)], options: &CopyOptions) -> Vec<usize> {
    if options.write.overwrite || options.world < 2 || options.exchange.is_none() {
        return Vec::new();
    }
    (0..targets.len())
        .filter(|&i| stage::is_index(&targets[i].1))
        .collect()
}

/// Rank 0's copy of a resuming group's indexes ([`ahead_of_group`]): the plan as it was and each
/// file's outcome ([`whole`]'s), or the copy's failure as the plan (the others hear of it when
/// the ranks agree).
fn indexes_ahead(planned: Planned, options: &CopyOptions) -> (Planned, Vec<Option<bool>>) {
    let Ok((targets, split)) = planned else {
        return (planned, Vec::new());
    };
    let outcomes = Mutex::new(vec![None; targets.len()]);
    let ahead = ahead_of_group(&targets, options);
    match run(&targets, &ahead, options, &outcomes, None) {
        Ok(()) => (
            Ok((targets, split)),
            outcomes.into_inner().unwrap_or_else(|e| e.into_inner()),
        ),
        Err(e) => (Err(e), Vec::new()),
    }
}
