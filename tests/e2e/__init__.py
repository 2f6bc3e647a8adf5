"""End to end: the browser, the demo, the README's examples, the JavaScript clients."""
