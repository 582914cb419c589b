"""Reading one `torch.save` file (a rank file, a full optimizer state) without unpickling.

Every failure of `torch.load(weights_only=True)` becomes one `ValueError` naming the file, with
torch's reason but never its advice to load the file with `weights_only=False`.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Mapping
from typing import Any

import torch


def load_file(path: str) -> Mapping[str, Any]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"SOURCE {path!r} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except RuntimeError as err:  # not a zip archive torch can read: truncated, not torch.save's
        raise ValueError(
            f"SOURCE {path!r} cannot be read by torch.load: {str(err).splitlines()[0]}"
        ) from err
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"SOURCE {path!r} is not a torch.save file of plain data; "
            f"torch.load(weights_only=True) refused it: {refusal(err)}"
        ) from err
    except Exception as err:  # whatever damaged bytes make torch.load raise (IndexError, OSError…)
        what = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        raise ValueError(f"SOURCE {path!r} is not a torch.save file (torch.load: {what})") from err
    if not isinstance(obj, Mapping):
        raise ValueError(f"SOURCE {path!r} holds a {type(obj).__name__}, not a state dict")
    return obj


def refusal(err: pickle.UnpicklingError) -> str:
    """Why `torch.load(weights_only=True)` refused a file, without torch's advice to load it
    with `weights_only=False` (which runs whatever the file holds)."""
    text = str(err)
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n|$)", text)
    if found:
        return found.group(1)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    kept = [ln for ln in lines if "weights_only" not in ln and not ln.startswith("Check the doc")]
    return kept[0] if kept else type(err).__name__
