"""PEFT adapter directories: reading their config, checking their tensors, saving them atomically.

A directory holds ``adapter_config.json`` and the weights in one of the two formats PEFT writes:
``adapter_model.safetensors`` (the default) or the legacy pickled ``adapter_model.bin``; PEFT loads the
safetensors file when both are there, so that is the one checked. Adapters other than ``default`` live in a
subdirectory named after them.

Saving writes the whole adapter into a hidden sibling directory, checks what was written (readable, the model's
keys and shapes, finite), then swaps it in with one ``renameat2(RENAME_EXCHANGE)`` (two renames where the
filesystem lacks it): a reader sees the old adapter or the new one, never half of one or a mix, and an error or
Ctrl-C while writing leaves the old one untouched. Files in the directory that are not the adapter's (a
Trainer checkpoint's optimizer state) are carried over as hard links; adapter files the new save did not write
(a stale ``adapter_model.bin``, another adapter's subdirectory) are not.

A model prepared by moecc also writes ``moecc_config.json`` beside the adapter (plain PEFT ignores it): the
family, the paradigm, the ``MoeccConfig`` fields (``expert_format`` and ``int4_group_size`` among them), the format
the base's experts were held in, and the LoRA shape it was trained with. ``moecc.prepare(adapter=
dir)`` takes its paradigm and settings from there, and loading an adapter into a prepared model (a Trainer
resuming from a checkpoint calls ``load_adapter``) first compares the directory with the model and names every
difference (family, rank, alpha, targets) in one message, before PEFT's or the optimizer's generic errors.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import shutil
import stat
import types
import uuid
from pathlib import Path

import torch
from peft import LoraConfig

from .errors import AdapterMismatchError, MoeccError
from .loading import read_json_object

CONFIG_NAME = "adapter_config.json"
SETTINGS_NAME = "moecc_config.json"  # moecc's settings beside the adapter
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's load order
ADAPTER_FILES = (CONFIG_NAME, SETTINGS_NAME, *WEIGHT_NAMES, "README.md")  # what a save owns in its directory
LORA_FIELDS = ("r", "lora_alpha", "target_modules", "target_parameters", "rank_pattern", "alpha_pattern")
_TEMP_TAG = ".moecc-tmp-"


def weights_file(directory: Path) -> Path | None:
    """The weights file PEFT would load from ``directory`` (safetensors first), or None."""
    return next((directory / name for name in WEIGHT_NAMES if (directory / name).is_file()), None)


def read_adapter_config(path: str | Path) -> LoraConfig:
    """Reads ``adapter_config.json`` from a PEFT adapter directory, with errors that name what is missing."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterMismatchError(f"adapter directory {str(directory)!r} does not exist")
    config_file = directory / CONFIG_NAME
    if not config_file.is_file() or weights_file(directory) is None:
        raise AdapterMismatchError(
            f"{str(directory)!r} is not a PEFT adapter directory: it needs {CONFIG_NAME} and "
            "adapter_model.safetensors or adapter_model.bin (as written by model.save_pretrained)"
        )
    fields = read_json_object(config_file, "adapter config", "the save was cut short or the file was edited: save "
                              "the adapter again", AdapterMismatchError)
    if fields.get("peft_type", "LORA") != "LORA":
        raise AdapterMismatchError(f"adapter in {str(directory)!r} is {fields.get('peft_type')}, not LoRA")
    try:
        return LoraConfig.from_pretrained(str(directory))
    except (TypeError, ValueError) as error:
        raise AdapterMismatchError(f"{str(config_file)!r} is not a LoRA configuration PEFT accepts: {error}") from None


def read_adapter_tensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an adapter weights file (either format); an unreadable file is named."""
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(file), device="cpu")
        else:
            tensors = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as error:  # SafetensorError, UnpicklingError, RuntimeError, EOFError, OSError
        raise AdapterMismatchError(
            f"adapter weights {str(file)!r} cannot be read ({type(error).__name__}: {str(error)[:200]}); the file "
            "is truncated or corrupted: save the adapter again or restore it from a copy"
        ) from None
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise AdapterMismatchError(f"adapter weights {str(file)!r} do not hold a dictionary of tensors")
    return tensors


def check_tensors(expected: dict[str, tuple], found: dict[str, torch.Tensor], where: str) -> None:
    """Raises AdapterMismatchError unless ``found`` has exactly the ``expected`` keys and shapes, all finite."""
    shapes = {key: tuple(t.shape) for key, t in found.items()}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = sorted(k for k in set(shapes) & set(expected) if shapes[k] != tuple(expected[k]))
    if missing or unexpected or wrong:
        details = []
        if missing:
            details.append(f"{len(missing)} tensors missing (e.g. {missing[0]})")
        if unexpected:
            details.append(f"{len(unexpected)} tensors the model has no place for (e.g. {unexpected[0]})")
        if wrong:
            details.append(f"shape mismatch for {wrong[0]}: adapter {shapes[wrong[0]]}, model {tuple(expected[wrong[0]])}")
        raise AdapterMismatchError(
            f"adapter {where} does not match this model: " + "; ".join(details)
            + ". Load it into the model architecture and size it was trained on."
        )
    bad = {key: int((~torch.isfinite(t)).sum()) for key, t in found.items() if t.is_floating_point()}
    bad = {key: count for key, count in sorted(bad.items()) if count}
    if bad:
        key, count = next(iter(bad.items()))
        raise AdapterMismatchError(
            f"adapter {where} holds non-finite values (NaN or inf): {count} of {found[key].numel()} in {key}"
            + (f" and {len(bad) - 1} more tensors" if len(bad) > 1 else "")
            + "; it was saved after training diverged or the file is corrupted: use an earlier checkpoint"
        )


def expected_shapes(peft_model: torch.nn.Module, adapter_name: str = "default") -> dict[str, tuple]:
    """The keys and shapes PEFT saves for ``adapter_name`` of ``peft_model``."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
    return {key: tuple(t.shape) for key, t in state.items()}


def check_adapter_matches(peft_model: torch.nn.Module, path: str | Path, adapter_name: str = "default") -> None:
    """Raises AdapterMismatchError unless the saved adapter (either format) has exactly the model's LoRA tensors
    and shapes, every value finite."""
    directory = Path(path)
    file = weights_file(directory)
    if file is None:
        raise AdapterMismatchError(f"{str(directory)!r} holds no adapter weights ({' or '.join(WEIGHT_NAMES)})")
    check_tensors(expected_shapes(peft_model, adapter_name), read_adapter_tensors(file), repr(str(directory)))


# --- moecc's settings beside the adapter ------------------------------------------------------------------------

def _lora_fields(config) -> dict:
    """The LoRA settings that shape an adapter's tensors, JSON-comparable (target sets as sorted lists)."""
    fields = {}
    for name in LORA_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, (set, list, tuple)):
            value = sorted(value)
        fields[name] = value if name in ("r", "lora_alpha") else (value or None)  # [] / {} / None: none
    return fields


def _config_fields(config) -> dict:
    """``MoeccConfig``'s fields as JSON values: a split policy object by its name."""
    fields = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    if not isinstance(fields.get("split_policy"), str):
        fields["split_policy"] = fields["split_policy"].name
    return fields


def write_settings(peft_model: torch.nn.Module, directory: Path, adapter_name: str = "default") -> None:
    """Writes ``moecc_config.json`` into ``directory`` for a model ``moecc.prepare`` returned (else nothing)."""
    state = getattr(peft_model, "moecc", None)
    if state is None:
        return
    from . import __version__

    settings = {
        "moecc_version": __version__,
        "family": state.family.model_type,
        "paradigm": state.paradigm,
        "config": _config_fields(state.config),
        "expert_format": state.expert_format,  # what the base's experts were held in ("int4", "bfloat16"...)
        "lora": _lora_fields(peft_model.peft_config[adapter_name]),
    }
    (directory / SETTINGS_NAME).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def read_settings(path: str | Path) -> dict | None:
    """The settings ``moecc_config.json`` in ``path`` holds, or None when there is none (a plain PEFT adapter)."""
    file = Path(path) / SETTINGS_NAME
    if not file.is_file():
        return None
    settings = read_json_object(file, "moecc settings", "delete it to load the adapter with the settings you pass, "
                                "or save the adapter again", AdapterMismatchError)
    if not isinstance(settings.get("config", {}), dict):
        raise AdapterMismatchError(f"{str(file)!r} is not moecc's settings file (expected a JSON object with "
                                   "'family', 'paradigm', 'config'); delete it or save the adapter again")
    return settings


def adapter_differences(peft_model: torch.nn.Module, path: str | Path, adapter_name: str = "default") -> list[str]:
    """How the adapter in ``path`` differs from ``adapter_name`` of ``peft_model``: family and LoRA settings."""
    differences = []
    settings = read_settings(path) or {}
    state = getattr(peft_model, "moecc", None)
    family = state.family.model_type if state is not None else getattr(peft_model.config, "model_type", None)
    if settings.get("family") not in (None, family):
        differences.append(f"family: adapter {settings['family']}, model {family}")
    saved = _lora_fields(read_adapter_config(path))
    current = _lora_fields(peft_model.peft_config[adapter_name])
    for name in LORA_FIELDS:
        if saved[name] != current[name]:
            differences.append(f"{name}: adapter {saved[name]!r}, model {current[name]!r}")
    return differences


def check_adapter_loads(peft_model: torch.nn.Module, path: str | Path, adapter_name: str = "default") -> None:
    """Raises AdapterMismatchError naming every difference between the adapter in ``path`` and the model's
    ``adapter_name`` (family, rank, alpha, targets; then tensor keys and shapes), before anything is loaded."""
    differences = adapter_differences(peft_model, path, adapter_name)
    if differences:
        raise AdapterMismatchError(
            f"adapter {str(path)!r} does not match this model's adapter {adapter_name!r}: " + "; ".join(differences)
            + ". Prepare the model with the same LoRA settings (moecc.prepare(model, adapter=path) reads them "
            "from the directory), or start from a checkpoint of this run"
        )
    check_adapter_matches(peft_model, path, adapter_name)
    settings = read_settings(path) or {}
    state = getattr(peft_model, "moecc", None)
    if state is not None and settings.get("paradigm") not in (None, state.paradigm):
        logging.getLogger("moecc").warning(
            "adapter %r was trained under paradigm %r, this model runs %r (the values load the same)",
            str(path), settings["paradigm"], state.paradigm)
    warn_if_format_differs(state, settings, path)


def warn_if_format_differs(state, settings: dict, path: str | Path) -> None:
    """Warns when the adapter in ``path`` was trained on experts held in another format than ``state``'s model
    (a LoRA trained on int4 weights learnt their rounding: on bf16 weights it computes something else)."""
    saved = settings.get("expert_format")
    if state is not None and saved not in (None, state.expert_format):
        logging.getLogger("moecc").warning(
            "adapter %r was trained on experts held in %s, this model holds them in %s (its LoRA corrects the "
            "other format's rounding); prepare with MoeccConfig(expert_format=...) as it was trained to continue "
            "on the same weights", str(path), saved, state.expert_format)


# --- atomic saving ---------------------------------------------------------------------------------------------

def save_adapter(peft_model: torch.nn.Module, save_directory: str | Path, check_finite: bool = True, **kwargs):
    """``peft_model.save_pretrained(save_directory, **kwargs)``, atomically (see the module docstring).

    Raises MoeccError, leaving ``save_directory`` as it was, when what PEFT wrote does not read back as the
    model's adapter or (with ``check_finite``) holds NaN or inf.
    """
    from peft import PeftModel

    if kwargs.get("is_main_process", True) is False:  # PEFT writes no weights there: nothing to make atomic
        return PeftModel.save_pretrained(peft_model, str(save_directory), **kwargs)
    target = Path(save_directory).absolute()
    if target.exists() and not target.is_dir():
        raise MoeccError(f"cannot save the adapter to {str(target)!r}: it exists and is not a directory")
    _refuse_unwritable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_temporaries(target)
    temporary = target.with_name(f".{target.name}{_TEMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(temporary)
        _keep_owner_and_mode(temporary, target)
        PeftModel.save_pretrained(peft_model, str(temporary), **kwargs)
        write_settings(peft_model, temporary)
        _check_written(peft_model, temporary, check_finite, target)
        _sync_tree(temporary)
        _swap_in(temporary, target)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)  # the new files after a failure, the old ones after a swap
    _sync_directory(target)
    _sync_directory(target.parent)


def may_write(directory: Path) -> bool:
    """Whether this process may create and rename entries in ``directory``. ``os.access`` decides for every user
    but root, whom it lets write anywhere: for root the mode bits of its class (owner, group or others) decide, so
    a directory made read-only stays read-only to every save."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    if os.geteuid() != 0:
        return True
    status = directory.stat()
    if status.st_uid == 0:
        wanted = stat.S_IWUSR | stat.S_IXUSR
    elif status.st_gid in (os.getegid(), *os.getgroups()):
        wanted = stat.S_IWGRP | stat.S_IXGRP
    else:
        wanted = stat.S_IWOTH | stat.S_IXOTH
    return status.st_mode & wanted == wanted


def _refuse_unwritable(target: Path) -> None:
    """Refuses, before anything is written, a save into a directory this process may not write (``may_write``):
    ``target`` itself when it exists (the save replaces it) and the directory its temporary goes into."""
    place = target.parent
    while not place.exists():
        place = place.parent  # the save creates the missing directories from here
    for directory in ([target] if target.exists() else []) + [place]:
        if not may_write(directory):
            status = directory.stat()
            raise MoeccError(
                f"cannot save the adapter to {str(target)!r}: {str(directory)!r} is not writable by this process "
                f"(mode {stat.filemode(status.st_mode)}, owner uid {status.st_uid}, this process uid "
                f"{os.geteuid()}); save to a directory you may write, or give write permission on it (moecc does "
                "not change a directory's owner or mode)")


def _keep_owner_and_mode(temporary: Path, target: Path) -> None:
    """Gives the new directory ``target``'s owner and mode, since it replaces ``target``; refuses (before writing)
    where this process cannot give it that owner."""
    if not target.exists():
        return
    wanted, made = target.stat(), temporary.stat()
    if (wanted.st_uid, wanted.st_gid) != (made.st_uid, made.st_gid):
        try:
            os.chown(temporary, wanted.st_uid, wanted.st_gid)
        except PermissionError:
            raise MoeccError(
                f"cannot save the adapter to {str(target)!r}: it is owned by uid {wanted.st_uid} (group "
                f"{wanted.st_gid}), and the save replaces the directory with a new one, which this process (uid "
                f"{os.geteuid()}) cannot give that owner; save as that user, or to a directory this process owns"
            ) from None
    os.chmod(temporary, stat.S_IMODE(wanted.st_mode))


def install_atomic_save(peft_model: torch.nn.Module) -> None:
    """Makes ``peft_model.save_pretrained`` (called by users, ``Trainer`` and ``accelerate``) save atomically,
    with moecc's settings, and ``peft_model.load_adapter`` (a Trainer's resume) check the directory first."""
    current = getattr(peft_model, "save_pretrained", None)
    if getattr(current, "__func__", None) is not _atomic_save_pretrained:
        peft_model.save_pretrained = types.MethodType(_atomic_save_pretrained, peft_model)  # rebinds under deepcopy
    current = getattr(peft_model, "load_adapter", None)
    if current is not None and getattr(current, "__func__", None) is not _checked_load_adapter:
        peft_model.load_adapter = types.MethodType(_checked_load_adapter, peft_model)


def _atomic_save_pretrained(self, save_directory, **kwargs):
    return save_adapter(self, save_directory, **kwargs)


def _checked_load_adapter(self, model_id, adapter_name: str = "default", *args, **kwargs):
    """``PeftModel.load_adapter`` after :func:`check_adapter_loads` when it replaces an adapter the model has."""
    if adapter_name in self.peft_config and Path(str(model_id)).is_dir():
        check_adapter_loads(self, model_id, adapter_name)
    return type(self).load_adapter(self, model_id, adapter_name, *args, **kwargs)


def _check_written(peft_model, temporary: Path, check_finite: bool, target: Path) -> None:
    """Every adapter PEFT wrote under ``temporary`` reads back with the model's keys and shapes (and finite)."""
    for name in list(peft_model.peft_config):
        directory = temporary if name == "default" else temporary / name
        file = weights_file(directory)
        if file is None:
            continue  # not selected for this save
        found = read_adapter_tensors(file)
        if not check_finite:
            found = {key: torch.zeros(()).expand(t.shape) for key, t in found.items()}
        try:
            check_tensors(expected_shapes(peft_model, name), found, f"{name!r} as written")
        except AdapterMismatchError as error:
            state = "is unchanged" if target.exists() else "was not created"
            raise MoeccError(f"not saved: {error} ({str(target)!r} {state}; pass check_finite=False to save "
                             "non-finite values anyway)") from None


def _carry_over(old: Path, new: Path) -> None:
    """Hard-links (copies, across filesystems) what ``old`` holds besides the adapter files into ``new``."""
    for entry in old.iterdir():
        if (entry.name in ADAPTER_FILES or (new / entry.name).exists()
                or (entry.is_dir() and (entry / CONFIG_NAME).is_file())):  # stale files of this or another adapter
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), new / entry.name)
        elif entry.is_dir():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, new / entry.name)


def _link_or_copy(source, destination) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _swap_in(temporary: Path, target: Path) -> None:
    """Puts ``temporary`` at ``target``; afterwards ``temporary`` holds the old directory, if there was one."""
    if not target.exists():
        os.rename(temporary, target)
        return
    _carry_over(target, temporary)
    if _exchange(temporary, target):
        return
    aside = target.with_name(f".{target.name}{_TEMP_TAG}{os.getpid()}-old-{uuid.uuid4().hex[:8]}")
    os.rename(target, aside)
    os.rename(temporary, target)
    os.rename(aside, temporary)


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two paths in one step (Linux renameat2); False where the system or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _remove_abandoned_temporaries(target: Path) -> None:
    """Deletes temporaries a killed save of ``target`` left behind (their process is gone)."""
    for entry in target.parent.glob(f".{target.name}{_TEMP_TAG}*"):
        pid = entry.name[len(f".{target.name}{_TEMP_TAG}"):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``, so a power loss after the swap cannot leave empty files."""
    for directory, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(directory, name), "rb") as handle:
                os.fsync(handle.fileno())
        _sync_directory(Path(directory))


def _sync_directory(directory: Path) -> None:
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
