"""The executors of the climb: they send work to agents and the cloud and build answers, and
decide nothing (``router.policy.climb`` does). ``classify`` runs a classifier request item by
item, ``generate`` a generative one, held until accepted; ``common`` is what they share."""
