"""import-linter contract types for the suite (pyproject.toml, [tool.importlinter]). `test_modules_apart`: no module
imports a test module (a `test_*` module under the given packages). What tests share lives in
tests/builders.py, a conftest.py (fixtures belong there) or another helper module, never in a module
pytest collects: importing one runs its tests' module-level code twice and ties a test's meaning to
another file's tests. import-linter's own wildcards replace whole module names only, hence this type.
`readers_only`: only the readers named may import a module (the fake API server, the generated gRPC
messages), checked over every importer in the graph (tests/test_contracts.py plants one)."""

from __future__ import annotations

from grimp import ImportGraph
from importlinter.application import contract_utils, output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class SeparateTestModulesContract(Contract):
    """Configuration options:
    - packages:       the packages whose `test_*` modules no module may import.
    - ignore_imports: imports to let pass (`importer -> imported`), as other contracts take them.
    """

    type_name = "test_modules_apart"

    packages = fields.SetField(subfield=fields.ModuleExpressionField())
    ignore_imports = fields.SetField(subfield=fields.ImportExpressionField(), required=False)
    unmatched_ignore_imports_alerting = fields.EnumField(
        contract_utils.AlertLevel, default=contract_utils.AlertLevel.ERROR
    )

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        removal = contract_utils.remove_ignored_imports_and_report(
            graph=graph,
            ignore_imports=self.ignore_imports,  # type: ignore[arg-type]  # the fields hold their parsed values
            unmatched_alerting=self.unmatched_ignore_imports_alerting,  # type: ignore[arg-type]
        )
        roots = tuple(str(package) for package in self.packages)  # type: ignore[attr-defined]
        tests = sorted(
            module
            for module in graph.modules
            if module.rpartition(".")[2].startswith("test_") and any(module.startswith(f"{r}.") for r in roots)
        )
        found = [
            (importer, imported, details["line_number"], details["line_contents"])
            for imported in tests
            for importer in sorted(graph.find_modules_that_directly_import(imported))
            for details in graph.get_import_details(importer=importer, imported=imported)
        ]
        return ContractCheck(
            kept=not found,
            warnings=list(removal.warnings),
            ignored_import_count=removal.ignored_import_count,
            metadata={"found": found},
        )

    def render_broken_contract(self, check: ContractCheck) -> None:
        for importer, imported, line, contents in check.metadata["found"]:
            output.print_error(f"{importer} imports the test module {imported}:", bold=True)
            output.indent_cursor()
            output.print_error(f"l.{line}: {contents}", bold=False)
            output.new_line()
        output.print("Move what they share into tests/builders.py or a conftest.py (fixtures); import it from there.")


class ReadersOnlyContract(Contract):
    """Configuration options:
    - modules: the modules (each with its descendants) only `readers` may import directly.
    - readers: the modules or packages (with their descendants) that may; the `modules` themselves may
      import each other.

    Every direct importer in the whole graph is checked, so a module added anywhere later is covered:
    nothing needs listing but the readers. (import-linter's `forbidden` type skips a forbidden module
    that sits inside a source package, which is why a list of sources could miss one.)"""

    type_name = "readers_only"

    modules = fields.SetField(subfield=fields.ModuleExpressionField())
    readers = fields.SetField(subfield=fields.ModuleExpressionField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        guarded = tuple(str(m) for m in self.modules)  # type: ignore[attr-defined]  # the fields hold parsed values
        allowed = (*guarded, *(str(r) for r in self.readers))  # type: ignore[attr-defined]

        def within(module: str, roots: tuple[str, ...]) -> bool:
            return any(module == root or module.startswith(f"{root}.") for root in roots)

        found = [
            (importer, imported, details["line_number"], details["line_contents"])
            for imported in sorted(m for m in graph.modules if within(m, guarded))
            for importer in sorted(graph.find_modules_that_directly_import(imported))
            if not within(importer, allowed)
            for details in graph.get_import_details(importer=importer, imported=imported)
        ]
        return ContractCheck(kept=not found, warnings=[], metadata={"found": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for importer, imported, line, contents in check.metadata["found"]:
            output.print_error(f"{importer} imports {imported}, which only its readers may:", bold=True)
            output.indent_cursor()
            output.print_error(f"l.{line}: {contents}", bold=False)
            output.new_line()
