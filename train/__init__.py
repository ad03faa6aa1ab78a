"""Trainers (SFT, DPO, GRPO, PRM) over exported search trees.

Not built yet: the losses, collation and trainers arrive with the trainers issue. The core
(``omrl_search``) never imports this package, so search stays light to install.
"""
