"""SimPO (``training.objective simpo``): the loss, rewards and logged statistics equal TRL's CPOTrainer's with
loss_type 'simpo' for the same model and batch (fp32), with and without its cpo_alpha NLL term, it trains from
``loom train``, and a run resumed mid-way continues bitwise."""

from __future__ import annotations

import pytest

from loom.config.errors import ConfigError
from loom.methods import check_config
from loom.methods.simpo import SimplePreference
from tests.unit.test_orpo import cli_run, compare, resume_check

SIMPO_STATS = {
    "rewards/chosen": "rewards/chosen",
    "rewards/rejected": "rewards/rejected",
    "rewards/margins": "rewards/margins",
    "rewards/accuracy": "rewards/accuracies",
    "logps/chosen": "logps/chosen",
    "logps/rejected": "logps/rejected",
    "nll_loss": "nll_loss",
}


@pytest.mark.parametrize("cpo_alpha", [0.0, 1.0])
def test_loss_and_statistics_equal_trl(tmp_path, cpo_alpha):
    trl = pytest.importorskip("trl", minversion="1.16")
    from trl.experimental.cpo import CPOTrainer

    assert trl.__version__ == "1.16.0"  # the version compared; another may move CPO's math
    beta, gamma = 2.0, 0.7
    compare(
        SimplePreference(beta, gamma, cpo_alpha),
        CPOTrainer,
        tmp_path,
        SIMPO_STATS,
        beta=beta,
        simpo_gamma=gamma,
        cpo_alpha=cpo_alpha,
        loss_type="simpo",
        alpha=0.0,
        label_smoothing=0.0,
    )


def test_config_rules(tiny):
    with pytest.raises(ConfigError, match="simpo.gamma"):
        check_config(tiny(**{"simpo.gamma": 1.0}))  # the section of another objective
    with pytest.raises(ConfigError, match="parallel.cp"):
        check_config(tiny(**{"training.objective": "simpo", "parallel.cp": 2}))
    check_config(tiny(**{"training.objective": "simpo", "simpo.gamma": 1.0, "simpo.cpo_alpha": 0.5}))


def test_trains_from_the_cli(tmp_path):
    from tests.unit.test_dpo import rows, write_jsonl

    cli_run(tmp_path, "simpo", write_jsonl(tmp_path / "p.jsonl", rows(40)), "rewards/margins")


@pytest.mark.slow
def test_resume_mid_run_continues_bitwise(tmp_path):
    """With the chosen NLL term on (cpo_alpha 0.5): steps 3..4 after a resume from step 2 equal the whole run's."""
    resume_check(tmp_path, "simpo", "rewards/margins", **{"simpo.cpo_alpha": 0.5})
