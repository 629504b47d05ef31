"""What the framework tests share: BarterCallback options under which a dozen steps hold several transfers, and
a TrainerCallback that watches the scores those transfers are chosen on."""
from transformers import TrainerCallback

QUICK_TRANSFERS = {"density": 0.5, "seed": 0, "window": (0.1, 0.9), "head_ratio": 1.0, "channel_ratio": 0.5}


class ScoreRecorder(TrainerCallback):
    """Placed after BarterCallback: at every optimizer step, before the transfers that follow it, whether the
    scores they are chosen on are non-zero in every layer with units, for each kind that has transfers planned
    (a kind with none, every layer at its full width, collects no scores)."""

    def __init__(self, barter_callback) -> None:
        self.barter_callback = barter_callback
        self.nonzero: list[bool] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        ctl = self.barter_callback.controller
        self.nonzero.append(all(float(d.abs().sum()) > 0 and float(s.abs().sum()) > 0
                                for kind in ("head", "channel") if ctl.schedule[kind]
                                for d, s in ctl.scores(kind).values() if d.numel()))
