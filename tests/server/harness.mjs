// What client.mjs and caches.mjs share: running a group's checks and reporting each.
export async function runChecks(script, group, checks) {
  if (checks.length === 0) {
    console.error(`${script}: unknown group '${group}'`);
    process.exit(2);
  }
  let failed = 0;
  for (const { name, fn } of checks) {
    const t0 = Date.now();
    try {
      await fn();
      console.log(`ok    ${group}: ${name} (${Date.now() - t0} ms)`);
    } catch (e) {
      ++failed;
      console.log(`FAIL  ${group}: ${name}\n      ${(e && e.stack) || e}`);
    }
  }
  console.log(`${group}: ${checks.length - failed} of ${checks.length} checks passed`);
  process.exit(failed ? 1 : 0);
}
