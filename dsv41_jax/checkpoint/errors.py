"""The one error type of checkpoint reading and writing (messages name the file, tensor or field at fault)."""


class CheckpointError(ValueError):
    pass
