"""The one error type of the data pipeline."""


class DataError(RuntimeError):
    """A corpus, dataset, tokenizer or stream state that cannot be used; the message names the cause and the fix."""
