"""Rows to examples to packed batches: dataset files, prompt formats and chat roles, masking, packing, and
the numbers qlora data prints. Imports qlora_cli.core, config and sources."""

from qlora_cli.data.examples import BatchPlan, Example, PreparedData, prepare_data
from qlora_cli.data.report import data_report, print_data_report

__all__ = ["BatchPlan", "Example", "PreparedData", "data_report", "prepare_data", "print_data_report"]
