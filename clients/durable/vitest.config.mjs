// The conformance suite's runner lives in node_modules, which vitest excludes by
// default: include it by name (tests/e2e/test_durable_conformance.py runs this).
export default {
  test: {
    include: ["node_modules/@durable-streams/server-conformance-tests/dist/test-runner.js"],
    exclude: [],
    fileParallelism: false,
    // vitest's default 5 s per test, on a shared 2-core test machine, timed out a 100 KB
    // read now and then (the same read takes 50 ms alone); the suite's own per-test
    // timeouts (its long-poll tests) are unchanged
    testTimeout: 20000,
  },
}
