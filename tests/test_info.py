"""``parambox info``: what parambox sees, as JSON and as the table a user reads."""

from __future__ import annotations

import json

from parambox.cli import main


def test_info_json_lists_what_this_machine_has_and_each_preset_in_a_whole_sentence(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"allreduce", "easgd", "diloco"} <= set(info["strategies"]) and "gpt" in info["models"]
    assert info["world"]["world_size"] == 1 and info["cpu_cores"] >= 1
    presets = info["presets"]
    assert "digits-allreduce" in presets
    # the first sentence, whole (a docstring's first line alone stopped mid-sentence)
    assert all(text.endswith((".", ")")) for text in presets.values()), presets
    assert (
        presets["digits-diloco"].startswith("DiLoCo on the default run")
        and "outer Nesterov step" in presets["digits-diloco"]
    )


def test_info_prints_a_table(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "parambox info" in out and "strategies" in out and "digits-allreduce" in out
