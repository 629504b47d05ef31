"""BARTER inside training frameworks: `barter.integrations.lightning.BarterCallback` for a `lightning.Trainer`,
`barter.integrations.hf.BarterCallback` for a Hugging Face `transformers.Trainer`.

Each callback takes `barter.wrap`'s keyword arguments except the model and the optimizer, wraps the model when
fitting starts, lets the transfers run after every optimizer step, exposes the live controller as
`.controller`, and saves and restores it with the framework's checkpoints. The frameworks are optional extras
(`pip install barter[lightning]`, `barter[hf]`); importing this package imports none of them.
"""
