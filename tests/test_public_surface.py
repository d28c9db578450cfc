"""Each package's public surface, guarded: the names it exports are listed here.

An export added by accident (a helper imported into a package's ``__init__``) or removed
by accident (a public name dropped in a refactoring) fails this test; a deliberate change
updates the list below in the same commit. As trio guards its exports, the names static
tools see (a lazy package's ``TYPE_CHECKING`` imports) must be the names it exports, and
every exported name must resolve.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent

SURFACE: dict[str, list[str]] = {
    "steeple.core": [
        "AuthenticationFailedError",
        "Backoff",
        "BrokerError",
        "BrokerReceipt",
        "BrokerRejectedError",
        "BrokerTimeoutError",
        "BrokerUnavailableError",
        "CAPABILITY_BYTES",
        "CLAIMABLE_STATES",
        "CLAIM_RULE",
        "ClaimRule",
        "Clock",
        "ConfigurationError",
        "ConfigurationTypeError",
        "CronCalendar",
        "DefinitionAdvance",
        "DueCalendar",
        "DueDefinition",
        "Effects",
        "FailureDecision",
        "FailureKind",
        "GENERATION_BYTES",
        "InvalidCronExpression",
        "InvalidTimeZoneError",
        "InvalidTransitionError",
        "KeyringConfigurationError",
        "KeyringError",
        "Lease",
        "MalformedEnvelopeError",
        "MessageBroker",
        "MessageTooLargeError",
        "MissedRunPolicy",
        "NamespaceTickPlan",
        "OCCURRENCE_STEPS",
        "OCCURRENCE_TRANSITIONS",
        "OccurrenceEvent",
        "OccurrenceInfo",
        "OccurrenceState",
        "PUBLISH_PURPOSE",
        "PURGED",
        "Page",
        "PublicationFailure",
        "PurgedType",
        "RELAY_BACKOFF",
        "RandomSource",
        "RecurringCapacityError",
        "RecurringClockError",
        "RecurringConfig",
        "RecurringConfigurationError",
        "RecurringConflictError",
        "RecurringDeadlineError",
        "RecurringDefinition",
        "RecurringError",
        "RecurringInvalidStateError",
        "RecurringKeyringError",
        "RecurringNotFoundError",
        "RecurringRelayError",
        "RecurringSchemaVersionError",
        "RecurringStorageError",
        "RecurringStore",
        "RecurringUnknownKeyIdError",
        "RelayAcknowledgementError",
        "RelayBrokerError",
        "RelayBrokerTimeoutError",
        "RelayLeaseLostError",
        "RelayOutcome",
        "RetryDecision",
        "ScheduleInfo",
        "ScheduleState",
        "ScheduledMessage",
        "SealBudgetExhaustedError",
        "Sealer",
        "SteepleError",
        "Step",
        "SystemClock",
        "SystemRandom",
        "TASK_TRANSITIONS",
        "TERMINAL_STATES",
        "TERMINAL_TASK_STATES",
        "TaskEvent",
        "TaskState",
        "TickPlan",
        "TickResult",
        "UnknownKeyIdError",
        "ZonedCalendar",
        "adopt_time",
        "after_publish_failure",
        "attempts_exhausted",
        "capability_digest",
        "capability_matches",
        "classify_publication_failure",
        "holds_lease",
        "idempotency_key",
        "is_claimable",
        "is_live",
        "lease_expiry",
        "lease_expiry_event",
        "new_capability",
        "new_generation",
        "occurrence_id_for",
        "plan_namespace_tick",
        "plan_tick",
        "publication_error",
        "retry_decision",
        "validate_budget",
        "window_end",
    ],
    "steeple.runtime": [
        "CRASH_POINTS",
        "DEFAULT_LOOP_LAG_THRESHOLD",
        "LoopLagMonitor",
        "LoopLagStatistics",
        "LoopStall",
        "arm",
        "check_loop_lag_threshold",
        "crash_point",
        "disarm",
        "register_crash_points",
        "watching_event_loop",
    ],
    "steeple.engine": [
        "DefinitionRow",
        "DefinitionUpdate",
        "EngineStore",
        "NamespaceOpening",
        "NamespaceState",
        "OccurrenceChange",
        "OccurrenceRow",
        "PURPOSE_DEFINITION",
        "PURPOSE_OCCURRENCE",
        "RecurringEngine",
        "RecurringRelay",
        "RecurringRepository",
        "RecurringStorage",
        "RelayStatistics",
        "RepositoryWork",
        "ServerClockReading",
        "StoredNamespace",
        "apply_step",
        "check_parts",
        "install_namespace",
        "judge_clock",
        "open_namespace",
        "read_clock",
        "recurring_errors",
        "seal_binding",
        "verify_binding",
    ],
    "steeple.keyring": [
        "BINDING_IDENTITY",
        "BINDING_PURPOSE",
        "BindingStatus",
        "BindingValue",
        "DEFAULT_SEAL_BUDGET",
        "ENVELOPE_VERSION",
        "KEY_ID_MAX_LENGTH",
        "KEY_SIZE",
        "Keyring",
        "KeyringStatistics",
        "MAGIC",
        "MAX_KEYS",
        "MAX_SEAL_BUDGET",
        "MIN_ENVELOPE_SIZE",
        "NONCE_SIZE",
        "StorageKey",
        "TAG_SIZE",
    ],
    "steeple.postgres": [
        "PostgresRecurringStore",
        "RecurringRelay",
        "RelayStatistics",
        "grant_runtime_role",
        "runtime_grant_statements",
    ],
    "steeple.postgres.queue": [
        "App",
        "ArgsEncodingError",
        "ClusterGuard",
        "DEFAULT_SCHEMA",
        "EnqueueOptions",
        "EnqueuedTask",
        "Handler",
        "Health",
        "JobContext",
        "JobError",
        "JobExistsError",
        "JobNotFoundError",
        "LIBRARY_SCHEMA_VERSION",
        "LeaseLostError",
        "PERIODIC_PREFIX",
        "ParentResult",
        "PeriodicJob",
        "PeriodicReport",
        "Progress",
        "QueueClusterError",
        "QueueConfigurationError",
        "QueueDeadlineError",
        "QueueError",
        "QueueInfo",
        "QueueTypeError",
        "QueueUnavailableError",
        "ResultEncodingError",
        "RetryPolicy",
        "Scheduler",
        "SchemaVersionMismatchError",
        "Step",
        "Task",
        "TaskAttempt",
        "TaskFunction",
        "TaskLimits",
        "TaskNotFoundError",
        "TaskRun",
        "TaskStateError",
        "UnfitDatabaseError",
        "UnknownTaskError",
        "UnsupportedConnectionError",
        "WorkerStats",
        "Workflow",
        "WorkflowCycleError",
        "WorkflowHandle",
        "WorkflowState",
        "WorkflowTask",
        "admin",
        "cancel",
        "check_schema",
        "enqueue",
        "enqueue_many",
        "enqueue_many_sync",
        "enqueue_sync",
        "enqueue_workflow",
        "enqueue_workflow_sync",
        "install",
        "jobs",
        "limit_queue",
        "limit_task",
        "list_queues",
        "parent_results",
        "pause_queue",
        "prune_terminal",
        "resume_queue",
        "run_state",
        "schema_version",
        "workflow_state",
    ],
    "steeple.sqlite": [
        "SqliteCorruptionError",
        "SqliteDiskFullError",
        "SqliteDurabilityError",
        "SqliteReadOnlyError",
        "SqliteRecurringStore",
        "SqliteStorageError",
    ],
    "steeple.brokers": [
        "BrokerFault",
        "DedupingConsumer",
        "Delivery",
        "JetStreamBroker",
        "JetStreamConsumer",
        "MemoryBroker",
        "RabbitMQBroker",
        "RabbitMQConsumer",
        "RedisStreamBroker",
        "RedisStreamConsumer",
        "SqliteJournalBroker",
        "WorkQueueBroker",
    ],
    "steeple.testing": [
        "BrokerFault",
        "DeterministicRandom",
        "FakeClock",
        "InMemoryRecurringStore",
        "MemoryBroker",
    ],
    "steeple.admin": [
        "ACTIONS",
        "CSRF_HEADER",
        "ExitCode",
        "SECURITY_HEADERS",
        "TaskAdmin",
        "TaskRecord",
        "WorkerApp",
        "create_admin_app",
    ],
}

# Names an ``__init__`` may hold besides its exports: typing-only imports.
TYPING_ONLY = {"annotations", "TYPE_CHECKING", "Any"}


def test_every_package_has_its_surface_listed() -> None:
    found = {
        f"steeple.{p.name}"
        for p in ROOT.glob("packages/*/src/steeple/*")
        if (p / "__init__.py").exists()
    }
    assert found <= set(SURFACE), f"packages without a listed surface: {found - set(SURFACE)}"


@pytest.mark.parametrize("package", sorted(SURFACE))
def test_the_exported_names_are_the_listed_ones(package: str) -> None:
    module = importlib.import_module(package)
    exported = list(module.__all__)
    assert len(exported) == len(set(exported)), f"{package}.__all__ repeats a name"
    assert sorted(exported) == SURFACE[package]


@pytest.mark.parametrize("package", sorted(SURFACE))
def test_every_exported_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None or name.isupper(), f"{package}.{name}"


def _own_submodule(package: str, value: object) -> bool:
    return isinstance(value, ModuleType) and value.__name__.startswith(package + ".")


@pytest.mark.parametrize("package", sorted(SURFACE))
def test_nothing_public_is_exported_by_accident(package: str) -> None:
    module = importlib.import_module(package)
    stray = [
        name
        for name, value in vars(module).items()
        if name.isidentifier()
        and not name.startswith("_")
        and name not in module.__all__
        and name not in TYPING_ONLY
        and not _own_submodule(package, value)
    ]
    assert stray == [], f"{package} holds public names outside __all__: {stray}"


def _statically_imported(package: str) -> set[str]:
    """The names an ``__init__`` binds by import, at module level or under TYPE_CHECKING."""
    source = Path(importlib.import_module(package).__file__ or "")
    names: set[str] = set()
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        body = node.body if isinstance(node, ast.If) else [node]
        for statement in body:
            if isinstance(statement, ast.ImportFrom):
                names.update(alias.asname or alias.name for alias in statement.names)
            elif isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(statement.name)
            elif isinstance(statement, ast.Assign):
                names.update(t.id for t in statement.targets if isinstance(t, ast.Name))
            elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                names.add(statement.target.id)
    return names


@pytest.mark.parametrize("package", sorted(SURFACE))
def test_static_tools_see_every_exported_name(package: str) -> None:
    missing = set(SURFACE[package]) - _statically_imported(package)
    assert missing == set(), f"{package} exports names a type checker cannot see: {missing}"


def _documented_first_use() -> list[str]:
    page = (ROOT / "docs" / "reference" / "index.md").read_text(encoding="utf-8")
    section = page.split("<!-- steeple:core-first-use -->")[1]
    return re.findall(r"`([A-Za-z_]+)`", section.split("<!-- /steeple:core-first-use -->")[0])


def test_the_core_names_a_user_imports_first_are_documented_and_exported() -> None:
    first_use = _documented_first_use()
    assert 10 <= len(first_use) <= 30, first_use
    assert set(first_use) <= set(SURFACE["steeple.core"]), set(first_use) - set(
        SURFACE["steeple.core"]
    )
    # The names DESIGN lists as the stable core are all among them.
    stable = {
        "CronCalendar", "MissedRunPolicy", "ScheduledMessage", "RecurringDefinition",
        "RecurringConfig", "Clock", "SystemClock", "MessageBroker", "RecurringError",
        "RecurringRelayError",
    }  # fmt: skip
    assert stable <= set(first_use), stable - set(first_use)
