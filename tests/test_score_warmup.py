"""wideep_kernels/score_warmup.py: the scoring layouts remembered on a device are found again
however the engine names that device (it passes "cuda"; tensors report "cuda:0"). Before, the
two never matched, and no wide variant was built before serving."""
import torch

import wideep_kernels.score_warmup as sw


def test_layouts_found_by_either_name_of_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(sw, "_SEEN", {})
    key = (torch.device("cuda", 0), "layouts")
    sw._SEEN[key] = key
    assert sw.layouts_on("cuda") == [key]
    assert sw.layouts_on(torch.device("cuda")) == [key]
    assert sw.layouts_on("cuda:0") == [key]
    assert sw.layouts_on("cuda:1") == [] and sw.layouts_on("cpu") == []


def test_remember_keys_cpu_calls_by_their_device(monkeypatch):
    monkeypatch.setattr(sw, "_SEEN", {})
    q, w = torch.zeros(2, 4, 16), torch.zeros(2, 4)
    keys = torch.zeros(64, 16)
    sw.remember(q, w, keys, None, 64, 1.0, 8)
    sw.remember(q, w, keys, None, 64, 1.0, 8)  # the same layout once
    assert len(sw.layouts_on("cpu")) == 1 and sw.layouts_on("cuda:0") == []
