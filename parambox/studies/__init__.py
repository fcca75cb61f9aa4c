"""Studies that answer "which strategy, how many workers, what batch size and learning rate": each
launches ``parambox train`` runs (``runs``, resumable), reads their loss curves (``curves``) and
writes tables and figures (``figures/``). ``grid`` is the sweep of SHM-Learn-Dist §5, ``neuron`` its
single-neuron study (§3), ``scaling`` its scaling study (§6). Nothing in the library imports them."""
