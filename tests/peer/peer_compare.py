"""Compare two junit-xml runs of the same tests (unpatched and patched by fastdit): counts and changed outcomes.

    python tests/peer/peer_compare.py BASE.xml PATCHED.xml [--method M] [--allow tests/peer/allowed_changes.txt]
                                      [--json OUT.json]

Prints each run's passed / failed / errors / skipped and every test whose outcome changed, with the
patched run's first message line. With ``--allow`` it exits 1 when a changed outcome is not in the
allow-list for ``--method``. Allow-list lines (``#`` starts a comment line):

    METHOD | TEST | REASON

METHOD is a method name or ``*``; TEST is a test id (``file.py::Class::test``, as printed here) or an
fnmatch pattern; REASON is required and says why the difference is inherent to the method.
"""
import argparse
import fnmatch
import json
import sys
import xml.etree.ElementTree as ET


def outcomes(path):
    """``{test id: (outcome, message)}`` of a junit-xml file written by pytest."""
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        parts = classname.split(".")
        # pytest writes "tests.models.transformers.test_x.Class"; turn the module part back into a path
        for i in range(len(parts), 0, -1):
            if parts[i - 1].startswith("test_"):
                test_id = "/".join(parts[:i]) + ".py" + "".join("::" + p for p in parts[i:]) + "::" + name
                break
        else:
            test_id = (classname + "::" + name) if classname else name
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        message = ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                message = (child.get("message") or child.text or "").strip().splitlines()
                message = message[0][:200] if message else ""
                break
        if "failure" in kinds and "error" in kinds:
            outcome = "failed+error"
        elif "failure" in kinds:
            outcome = "failed"
        elif "error" in kinds:
            outcome = "error"
        elif "skipped" in kinds:
            outcome = "skipped"
        else:
            outcome = "passed"
        result[test_id] = (outcome, message)
    return result


def counts(run):
    c = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for outcome, _ in run.values():
        if outcome == "passed":
            c["passed"] += 1
        if "failed" in outcome:
            c["failed"] += 1
        if "error" in outcome:
            c["errors"] += 1
        if outcome == "skipped":
            c["skipped"] += 1
    return c


def changes(base, patched):
    """``[(test id, base outcome, patched outcome, patched message)]`` for tests whose outcome differs
    (a test present in one run only counts as changed, with outcome ``absent`` in the other); only the
    test files present in both runs are compared."""
    found = []
    # only the test files both runs ran (an unpatched run of more files can be reused for a subset)
    files = {t.split("::")[0] for t in base} & {t.split("::")[0] for t in patched}
    for test_id in sorted(t for t in set(base) | set(patched) if t.split("::")[0] in files):
        a = base.get(test_id, ("absent", ""))
        b = patched.get(test_id, ("absent", ""))
        if a[0] != b[0]:
            found.append((test_id, a[0], b[0], b[1] or a[1]))
    return found


def load_allow_list(path):
    """``[(method, pattern, reason)]``; a line without a reason is an error."""
    entries = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = [p.strip() for p in line.split("|", 2)]
            if len(parts) != 3 or not all(parts):
                raise SystemExit(f"{path}:{number}: expected 'METHOD | TEST | REASON' (a reason is required): {line!r}")
            entries.append(tuple(parts))
    return entries


def allowed(entries, method, test_id):
    return next((reason for m, pattern, reason in entries
                 if (m == "*" or m == method) and (test_id == pattern or fnmatch.fnmatchcase(test_id, pattern))), None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("patched")
    parser.add_argument("--method", default="?")
    parser.add_argument("--allow", help="allow-list file: exit 1 on a changed outcome it does not list")
    parser.add_argument("--json", help="write counts and changes here")
    args = parser.parse_args(argv)
    base, patched = outcomes(args.base), outcomes(args.patched)
    files = {t.split("::")[0] for t in patched}
    base = {t: o for t, o in base.items() if t.split("::")[0] in files}  # the files the patched run ran
    cb, cp = counts(base), counts(patched)
    changed = changes(base, patched)
    entries = load_allow_list(args.allow) if args.allow else []
    print(f"unpatched:      {cb['passed']} passed, {cb['failed']} failed, {cb['errors']} errors, {cb['skipped']} skipped")
    print(f"{args.method + ':':<15} {cp['passed']} passed, {cp['failed']} failed, {cp['errors']} errors, {cp['skipped']} skipped")
    print(f"changed outcomes: {len(changed)}")
    unlisted = []
    for test_id, a, b, message in changed:
        reason = allowed(entries, args.method, test_id) if args.allow else None
        mark = f"  [allowed: {reason}]" if reason else ""
        print(f"  {a} -> {b}: {test_id}{mark}")
        if message and b != "passed":
            print(f"      {message}")
        if args.allow and not reason:
            unlisted.append(test_id)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"method": args.method, "unpatched": cb, "patched": cp,
                       "changed": [dict(test=t, unpatched=a, patched=b, message=m) for t, a, b, m in changed],
                       "unlisted": unlisted}, f, indent=1)
    if unlisted:
        print(f"{len(unlisted)} changed outcome(s) not in the allow-list {args.allow}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
