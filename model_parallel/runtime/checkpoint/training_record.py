"""What a checkpoint records of how its run trained, and the check that a resume trains the same way.

    record = training_record(config, dataset, next_step, optimizer)   # stored in the manifest's extra["training"]
    check_resume(stored, record, allow=False, where=...)   # ConfigError naming every field that changed

A resume that silently trained with another batch size (the worker's default 8 where the run had used
32) computes something else than the run it claims to continue: every field below that changed is
refused, named with both values, unless the user accepts it (`--allow_config_change`, then logged).
The optimizer is recorded as its class and constructor defaults (lr, momentum, ...): a resume that steps
Adam's state with SGD, or continues at 30x the lr, is not the run it continues either. A factory that builds
parameter groups (no weight decay on biases and norms: a rule on `p.ndim`, since it gets tensors, not names) is
recorded by what it gives a matrix and a vector beyond the defaults (`param_groups`, the factory run on two probe
tensors, the same on every rank), so a group's lr or weight decay changed on resume is refused like the defaults. A record written before
a field was recorded (an older checkpoint) leaves it unknown: not compared.
The data is recorded by its description and a fingerprint of its contents, compared by the fingerprint where both
records hold one (data_identity.py: the same file by another path is the same data, another of the same size is not).
The graph's structure is recorded and compared too (graph_identity.py: the parameters alone do not tell a model with
dropout from one without). The loss is recorded by its qualified name and settings (loss_identity.py: label
smoothing, class weights, a lambda's code). The data position (epoch, minibatch) is recorded too; it follows from the step, so it is not compared.
"""
from __future__ import annotations

import logging
import re
import shlex
from collections.abc import Callable, Mapping
from typing import Any, Optional

from model_parallel.errors import ConfigError
from model_parallel.runtime.checkpoint.data_identity import data_change, data_content, describe_data, unverified

__all__ = ["advice", "changed_fields", "check_resume", "describe_data", "describe_groups", "describe_optimizer",
           "probe_optimizer", "training_record"]

logger = logging.getLogger(__name__)

# The fields a resume must keep, in the order a refusal names them.
COMPARED = ("batch_size", "num_microbatches", "schedule", "seed", "lr_schedule", "precision", "clip_grad", "loss", "data",
            "optimizer", "lr", "momentum", "weight_decay", "betas", "eps", "param_groups", "graph")
# The optimizer's: its kind ("sgd", "adamw": the class name, as --optimizer spells it) and the defaults it was built
# with. A field one optimizer has and the other lacks (SGD's momentum, Adam's betas) is not compared: the kind is.
OPTIMIZER_FIELDS = ("optimizer", "lr", "momentum", "weight_decay", "betas", "eps")
# Compared only where this run records them too (a factory that fails on the probe tensors records none).
RECORDED_IF_KNOWN = OPTIMIZER_FIELDS + ("param_groups", "graph", "loss")
# The losses the command line names (--loss), by what loss_identity.describe_loss records of them.
CLI_LOSSES = {"torch.nn.functional.cross_entropy": "cross_entropy", "model_parallel.models.gpt.lm_loss": "lm"}


def _settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The recorded hyperparameters among `values` (JSON: betas as a list, a tensor lr or an int decay as a float)."""
    out: dict[str, Any] = {}
    for key in OPTIMIZER_FIELDS[1:]:
        value = values.get(key)
        if isinstance(value, (tuple, list)):
            out[key] = [float(v) for v in value]
        elif value is not None:
            out[key] = float(value)
    return out


def describe_optimizer(optimizer: Any) -> dict[str, Any]:
    """The optimizer's kind and constructor defaults."""
    return {"optimizer": type(optimizer).__name__.lower(), **_settings(getattr(optimizer, "defaults", None) or {})}


def describe_groups(factory: Any) -> dict[str, Any]:
    """{"param_groups": {"matrix": overrides, "vector": overrides}}: what the factory's groups give a 2-D and a 1-D
    parameter where it differs from the optimizer's defaults ({} for a factory without groups; None: left out of
    every group), so a change of the defaults (--lr) is named once, as itself; {} if the factory fails on the
    probe tensors."""
    import torch

    probes = {"matrix": torch.nn.Parameter(torch.zeros(2, 2)), "vector": torch.nn.Parameter(torch.zeros(2))}
    try:
        optimizer = factory(list(probes.values()))
        groups = list(optimizer.param_groups)
    except Exception as error:  # noqa: BLE001 - then not recorded: not compared, not fatal
        logger.debug("parameter groups not recorded: the factory failed on probe tensors (%s: %s)", type(error).__name__, error)
        return {}
    defaults = _settings(getattr(optimizer, "defaults", None) or {})
    out: dict[str, Any] = {}
    for name, probe in probes.items():
        group = next((g for g in groups if any(q is probe for q in g.get("params", ()))), None)
        out[name] = None if group is None else {k: v for k, v in _settings(group).items() if defaults.get(k) != v}
    return {"param_groups": out}


def probe_optimizer(built: Any, factory: Any) -> Any:
    """The optimizer to record: the one built on this rank, else one the factory builds on a probe tensor (a rank
    without parameters builds none; every rank must compute the same record). None if the factory fails on it."""
    if built is not None:
        return built
    import torch

    try:
        return factory([torch.nn.Parameter(torch.zeros(1))])
    except Exception as error:  # noqa: BLE001 - the record is then without the optimizer: not compared, not fatal
        logger.debug("optimizer not recorded: its factory failed on a probe tensor (%s: %s)", type(error).__name__, error)
        return None


def training_record(config: Any, dataset: Any, next_step: int, optimizer: Any = None,
                    groups: Optional[Mapping[str, Any]] = None, graph: Any = None, criterion: Any = None) -> dict[str, Any]:
    """The training configuration of a run (a `TrainConfig`, its `optimizer`, `groups` (`describe_groups`),
    `graph`'s structure (graph_identity.py) and `criterion` (loss_identity.py) if given) and where its data stands
    at `next_step` (JSON)."""
    from model_parallel.runtime.checkpoint.graph_identity import describe_graph
    from model_parallel.runtime.checkpoint.loss_identity import describe_loss
    from model_parallel.runtime.data.sources import position

    # A schedule `--schedule auto` chose is recorded as "auto": a resume may choose again (all flush schedules train alike).
    # `schedule_running`: the one it ran when the checkpoint was taken (auto may have chosen again at a live switch);
    # not compared on resume. A recovery's stand-in schedule (TrainConfig.schedule_asked) records the one asked for.
    schedule = "auto" if getattr(config, "schedule_auto", False) else getattr(config, "schedule_asked", None) or config.schedule
    return {
        "batch_size": config.batch_size, "num_microbatches": config.num_microbatches, "schedule": schedule,
        "schedule_running": config.schedule,
        "seed": config.seed, "lr_schedule": config.lr_schedule, "precision": "bf16" if config.bf16 else "float32",
        "clip_grad": config.clip_grad, "data": describe_data(dataset),
        **({"data_content": content} if (content := data_content(dataset)) is not None else {}),
        "data_position": {"next_step": next_step, **position(dataset, next_step)},
        **(describe_optimizer(optimizer) if optimizer is not None else {}),
        **(groups or {}),
        **({"graph": describe_graph(graph)} if graph is not None else {}),
        **({"loss": loss} if criterion is not None and (loss := describe_loss(criterion)) is not None else {}),
    }


def update_rule(schedule: Any) -> Any:
    """What a schedule trains: every flush schedule (and "auto", which chooses one) one update of the whole minibatch
    per step, to the same parameters (bitwise on CPU: 1f1b, gpipe, interleaved, zbh1, zbv resumed from one checkpoint
    end equal); pipedream its own asynchronous updates. A resume is refused only where this differs."""
    from model_parallel.graph.in_flight import FLUSH_SCHEDULES

    return "flush" if schedule in FLUSH_SCHEDULES + ("auto",) else schedule


def changed_fields(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any, str]]:
    """(field, stored value, current value, why) of every compared field that differs (fields the record lacks:
    unchanged; an optimizer field this run lacks too: its optimizer has no such setting, or it is unknown). The data
    is compared by its contents where both records hold them (data_identity.py): `why` says what differs. A schedule
    is compared by what it trains (`update_rule`): one flush schedule for another is no change."""
    changed = []
    for key in COMPARED:
        if key not in stored or (key in RECORDED_IF_KNOWN and key not in current):
            continue
        if key == "schedule":
            why = None if update_rule(stored[key]) == update_rule(current.get(key)) else ""
        else:
            why = data_change(stored, current) if key == "data" else ("" if stored[key] != current.get(key) else None)
        if why is not None:
            changed.append((key, stored[key], current.get(key), why))
    return changed


def advice(field: str, value: Any) -> str:
    """How to give `field` the checkpoint's `value` again, as a command line takes it (or the API, where none does)."""
    if field in ("betas", "eps"):  # no command-line flag: only an optimizer_factory sets them
        return f"an optimizer_factory building the optimizer with {field}={tuple(value) if isinstance(value, list) else value}"
    if field == "graph":
        return "--graph with the graph the run trained (its checkpoint's step_<N>/graph.json)"
    if field == "loss":
        return f"--loss {CLI_LOSSES[value]}" if value in CLI_LOSSES else f"the criterion the run trained with ({value})"
    if field == "param_groups":
        return f"an optimizer_factory whose parameter groups give matrices and vectors {value}"
    if value is None:  # clip_grad None: the flag takes no "None", leaving it out is how
        return f"without --{field}"
    if field == "precision":
        return "--bf16" if value == "bf16" else "without --bf16"
    if field == "data":  # "tokens:PATH (N samples)", "synthetic dense": the flag's value is what precedes
        value = "synthetic" if str(value).startswith("synthetic ") else re.sub(r" \(\d+ samples\)$", "", str(value))
    return f"--{field} {shlex.quote(str(value))}"


def check_resume(stored: Optional[Mapping[str, Any]], current: Mapping[str, Any], allow: bool, where: str,
                 details: Optional[Mapping[str, Callable[[], str]]] = None) -> list[str]:
    """Refuse (ConfigError) a resume that changes a recorded field, or with `allow` log each change; returns them.
    `details`: what a changed field's change line adds, asked only when it changed (the graph's first difference)."""
    if not isinstance(stored, Mapping):
        logger.warning("%s records no training configuration (written before it was recorded): the resume cannot "
                       "check that batch size, microbatches, schedule, seed, lr schedule, precision, loss, data and optimizer are the same",
                       where)
        return []
    if unverified(stored, current):
        logger.warning("%s was written before the data's contents were recorded: the resume cannot verify that this "
                       "run's data (%s) holds what the run trained on, only its name", where, current.get("data"))
    details = details or {}
    changed = changed_fields(stored, current)
    if "schedule" in stored and stored["schedule"] != current.get("schedule") and all(c[0] != "schedule" for c in changed):
        logger.info("%s was trained with schedule %r, this run with %r: flush schedules train the same parameters, so "
                    "the resume continues the run exactly", where, stored["schedule"], current.get("schedule"))
    changes = []
    for key, old, new, why in changed:
        why = why or (details[key]() if key in details else "")
        changes.append(f"{key} {old!r} -> {new!r}" + (f" ({why})" if why else ""))
    if changes and not allow:
        first = changed[0][0]
        raise ConfigError(f"--resume from {where}: the run was trained with a different {first}: {'; '.join(changes)} "
                          f"(checkpoint -> this run); resume with the checkpoint's settings (e.g. "
                          f"{advice(first, stored[first])}), or pass --allow_config_change (RunOptions.allow_config_change) to accept the change")
    for change in changes:
        logger.warning("--allow_config_change: resuming from %s with %s (checkpoint -> this run)", where, change)
    return changes
