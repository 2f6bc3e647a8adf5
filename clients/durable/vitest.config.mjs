// The conformance suite's runner lives in node_modules, which vitest excludes by
// default: include it by name (tests/e2e/test_durable_conformance.py runs this).
export default {
  test: {
    include: ["node_modules/@durable-streams/server-conformance-tests/dist/test-runner.js"],
    exclude: [],
    fileParallelism: false,
  },
}
