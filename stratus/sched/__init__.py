"""The queue owners: the dynamic batcher (merging requests into batches by their slack) and
the bounded executor that runs blocking calls off the event loop. Each queue has one owner."""
