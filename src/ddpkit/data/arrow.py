"""Batches of a Hugging Face Arrow dataset read straight from its columns.

``dataset[indices]`` on a ``datasets.Dataset`` in torch format gathers the
rows (``query_table``), then its formatter walks the batch through Python
objects: a column of fixed-size lists becomes one numpy array per row, then
one tensor per row, then a stack. For columns of numbers and fixed-size lists
of numbers, the gathered Arrow columns convert to numpy in one call each::

    query_table(rows)  ->  image: FixedSizeList<uint8>[784] x 32  ->  flatten().to_numpy().reshape(32, 784)
                           label: int64 x 32                      ->  to_numpy()
                        ->  HF's TorchFormatter.recursive_tensorize (its dtypes: integers as int64)

the same tensors, 2.5x faster for 32 rows of 784 pixels. Any other column
(strings, images, nested or variable-length lists), format options, a
transform, or a batch with nulls takes HF's own path.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ArrowBatchReader", "arrow_batch_reader"]


def _numeric(arrow_type: Any) -> bool:
    import pyarrow as pa  # type: ignore[import-untyped]  # pyarrow ships no type information

    return bool(pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type) or pa.types.is_boolean(arrow_type))


def _columns_read_directly(dataset: Any) -> list[str] | None:
    """The dataset's output columns when each is numbers or fixed-size lists of numbers; else None."""
    import pyarrow as pa  # (untyped: see _numeric)

    fmt = dataset.format
    if fmt.get("type") != "torch" or fmt.get("format_kwargs") or fmt.get("output_all_columns"):
        return None
    columns = fmt.get("columns") or dataset.column_names
    schema = dataset.data.schema
    for name in columns:
        arrow_type = schema.field(name).type
        if pa.types.is_fixed_size_list(arrow_type):
            arrow_type = arrow_type.value_type
        if not _numeric(arrow_type):
            return None
    return list(columns)


class ArrowBatchReader:
    """``reader(indices)``: the batch ``dataset[indices]`` returns, read column by column (picklable for workers).

    Args:
        dataset: a ``datasets.Dataset`` in torch format.
        columns: its output columns, all numbers or fixed-size lists of numbers.
    """

    def __init__(self, dataset: Any, columns: list[str]):
        self.dataset, self.columns = dataset, columns
        self._formatter: Any = None

    def __call__(self, indices: list[int]) -> dict[str, Any]:
        # (pyarrow and Hugging Face datasets ship no type information.)
        import pyarrow as pa
        from datasets.formatting import query_table  # type: ignore[import-untyped]
        from datasets.formatting.torch_formatter import TorchFormatter  # type: ignore[import-untyped]

        dataset = self.dataset
        table = query_table(dataset._data, indices, indices=dataset._indices)  # HF's gather, its index mapping too
        arrays = {}
        for name in self.columns:
            column = table.column(name).combine_chunks()
            if column.null_count:
                batch: dict[str, Any] = dataset[indices]  # HF's path knows what a null becomes
                return batch
            if pa.types.is_fixed_size_list(column.type):
                # flatten(), unlike .values, honours the gathered array's offset.
                values = column.flatten().to_numpy(zero_copy_only=False)
                arrays[name] = values.reshape(len(column), column.type.list_size)
            else:
                arrays[name] = column.to_numpy(zero_copy_only=False)
        if self._formatter is None:
            self._formatter = TorchFormatter(features=dataset.features)
        tensors: dict[str, Any] = self._formatter.recursive_tensorize(arrays)
        return tensors

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "columns": self.columns, "_formatter": None}


def arrow_batch_reader(dataset: Any) -> ArrowBatchReader | None:
    """An :class:`ArrowBatchReader` for ``dataset``, or None where HF's own path is needed."""
    columns = _columns_read_directly(dataset)
    return ArrowBatchReader(dataset, columns) if columns is not None else None
