// What this machine can do, as the benchmarks' rooflines need it.
#pragma once

namespace cachet {

// Bytes per second that `threads` threads read from memory, each streaming its share of a 512 MiB
// buffer (far larger than the caches) with full-vector loads, once with a software prefetch 1 KiB
// ahead and once without: the faster pattern's median of five passes (which one is faster depends
// on the CPU). Allocates and touches the buffer first.
double MeasureReadBandwidth(int threads);

// Bytes of physical memory (0 if the system does not say): a KV pool or a benchmark's cache that
// would outgrow it is refused up front.
double PhysicalMemoryBytes();

}  // namespace cachet
