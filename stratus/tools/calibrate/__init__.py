"""``stratus models calibrate``: each tier's escalation threshold from labelled data, for a
classifier family (:mod:`.classifier`) or a generative one (:mod:`.generative`)."""
