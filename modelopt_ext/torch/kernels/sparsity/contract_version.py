"""The version of docs/skip_softmax.md (the contract) every skip-softmax path implements, importable without torch.

Its one definition: the kernels' `semantics.CONTRACT_VERSION` and the checkpoint's `constants.CONTRACT_VERSION`
(written into a calibrated `skip_softmax` group as `contract_version`) are this number, and the compiled CPU kernel
is built with it. Here rather than in semantics.py because the checkpoint side must import without torch.
"""

CONTRACT_VERSION = 5
"""5: a row's reference max also holds its recent-window tiles' max (4: block / group decisions and the recent
window; docs/skip_softmax.md, "Why version N")."""
