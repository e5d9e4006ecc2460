"""A pipeline file checked as ``kvcompose validate``, ``render`` and ``serve`` check it.

First the file and its schema (:func:`kvcompose.config.load_pipeline`), then
what kvcompose knows of each child without importing vLLM: its connector's
settings (:mod:`kvcompose.connector_settings`) and the modules it names
(:mod:`kvcompose.module_lookup`). A module that is not found is an error
where vLLM is installed, and a warning where it is not: the file may be
checked away from the engine's environment, which may hold the module.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcompose.config import Pipeline, load_pipeline
from kvcompose.connector_settings import named_classes, settings_problems
from kvcompose.errors import PipelineConfigError, Problem
from kvcompose.module_lookup import module_problem
from kvcompose.render import file_reference, inline_reference
from kvcompose.source import (
    PipelineDocument,
    read_pipeline_source,
    read_pipeline_stream,
)

STDIN = "-"  # the file name that reads a pipeline from standard input


@dataclass(frozen=True)
class CheckedPipeline:
    """A pipeline with no problem left but ``warnings``; ``path`` is None when it came from standard input."""

    document: PipelineDocument
    pipeline: Pipeline
    warnings: tuple[Problem, ...]
    path: Path | None

    def print_warnings(self) -> None:
        for warning in self.warnings:
            print(warning.describe(self.document.label), file=sys.stderr)

    def reference(self, inline: bool) -> str | dict[str, Any]:
        """How the engine finds the pipeline: the file's absolute path, or (``inline``, or read from
        standard input, which the engine cannot read again) the pipeline itself."""
        if inline or self.path is None:
            return inline_reference(self.document)
        return file_reference(self.path)


def check_pipeline(file: Path) -> CheckedPipeline:
    """Read and check ``file`` (``-``: standard input); raises :class:`PipelineConfigError` listing every error."""
    from_stdin = str(file) == STDIN
    document = read_pipeline_stream(sys.stdin.buffer) if from_stdin else read_pipeline_source(file)
    pipeline = load_pipeline(document)
    found = sorted((_located(problem, document) for problem in child_problems(pipeline, vllm_installed())),
                   key=lambda problem: problem.line or 0)
    if any(not problem.warning for problem in found):
        raise PipelineConfigError(found, document.label)  # the warnings too: every line in one pass
    warnings = tuple(problem for problem in found if problem.warning)
    return CheckedPipeline(document, pipeline, warnings, None if from_stdin else file)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None  # finds it without importing it


def child_problems(pipeline: Pipeline, vllm_here: bool) -> list[Problem]:
    """Every child's settings and named modules that the engine could not use."""
    problems = []
    for index, child in enumerate(pipeline.children):
        problems += settings_problems(child, index)
        for named in named_classes(child):
            found = module_problem(named.module, named.name)
            if found is not None:
                hint = "; vLLM is not installed here either, so this may not be the engine's environment" \
                    if found.missing and not vllm_here else ""
                problems.append(Problem(("children", index, *named.key), found.message + hint,
                                        warning=found.missing and not vllm_here))
    return problems


def _located(problem: Problem, document: PipelineDocument) -> Problem:
    return Problem(problem.path, problem.message, document.line_of(problem.path), problem.warning)
