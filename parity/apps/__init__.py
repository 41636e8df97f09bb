"""The applications above the library: one module per `parity` command (its body), the base
policy recipe (`sft`), the demo and the study, and the terminal UI they share. The library
(`ops`, `model`, `engine`, `config`, `envs`, `metrics`, `rl`, `invariance`) never imports from here."""
