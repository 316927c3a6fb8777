# KL vs bits held on kvtiny (docs/BENCHMARKS.md, "Calibrated codecs"): every codec of the batch-
# scored tables (8 x 2048 held-out pydocs windows) and llama.cpp's own q8_0 / q4_0 cache (its 8 x
# 1024 windows, each engine against its own f32 run: "llama.cpp side by side"); cq4 from "Calibrated
# q4_0 (cq4)", gear4 and cq4:cq2 from "GEAR: q4_0 and a rank-4 correction" (bits held with 32-bit
# positions, as the others here: +0.125 on what that section prints).
# Run from the repository root: gnuplot bench/plots/kl_vs_bits_calibrated.gp
# Columns: bits held, mean KL, label, where the label goes (x, y: about a character each).
set terminal svg size 900,560 noenhanced font 'sans,12' background rgb 'white'
set output 'docs/img/kl_vs_bits_calibrated.svg'
set title 'kvtiny: mean KL vs bits held per K/V value (batch scoring)'
set xlabel 'bits held per K/V value (codes, scales, positions)'
set ylabel 'mean KL vs the f32 cache, nats'
set logscale y
set grid
set key below
set xrange [2:10]
set yrange [3e-4:5]
$plain << EOD
8.75 6.4e-4 q8_0 2 -0.6
8.75 8.4e-4 int8 2 0.6
7.0 2.9e-2 q8_0:kivi4 0 -1
6.75 3.5e-2 int8:q4_0 0 1
5.75 4.8e-2 kivi4 0 1
4.75 7.3e-2 kivi4:q4_0(64) 4.5 -0.6
4.75 0.173 q4_0 2.5 -0.4
4.50 0.182 rot4 0.5 2
3.75 0.65 rot3 2.5 0
3.75 1.29 kivi2 2.5 0.3
2.75 1.94 rot2 2.5 0
EOD
$pca << EOD
4.50 0.110 pca4 -2.5 -0.3
4.62 0.094 pca4:q4_0 -3 -1.1
3.50 0.385 pca3 -2.5 0
2.50 1.24 pca2 -2.5 0
EOD
$kvq << EOD
4.62 0.063 kvq4 -2.5 -1.2
4.69 0.066 kvq4:q4_0 8 1.3
4.12 0.160 kvq4:kvq3 -2 -1.3
3.62 0.242 kvq3 0.5 0.6
2.62 0.868 kvq2 0.5 0.6
EOD
$cq4 << EOD
4.75 0.112 cq4 2.2 -0.2
3.75 0.697 cq4:cq2 0.5 0.6
EOD
$gear << EOD
5.50 0.133 gear4 2.5 0.3
5.12 0.138 gear4:q4_0 3 -0.6
EOD
$llama << EOD
8.5 8.5e-4 llama.cpp_q8_0 -6 0.6
4.5 0.18 llama.cpp_q4_0 -8 0
EOD
plot $plain using 1:2 with points pt 7 ps 1.2 lc rgb '#1f77b4' title 'Cachet', \
     '' using ($1+$4*0.07):($2*10**($5*0.09)):3 with labels font ',10' notitle, \
     $pca using 1:2 with points pt 5 ps 1.3 lc rgb '#d62728' title 'Cachet, calibrated (pca)', \
     '' using ($1+$4*0.07):($2*10**($5*0.09)):3 with labels font ',10' tc rgb '#d62728' notitle, \
     $kvq using 1:2 with points pt 13 ps 1.4 lc rgb '#9467bd' title 'Cachet, calibrated (kvq: keys before RoPE)', \
     '' using ($1+$4*0.07):($2*10**($5*0.09)):3 with labels font ',10' tc rgb '#9467bd' notitle, \
     $cq4 using 1:2 with points pt 11 ps 1.5 lc rgb '#ff7f0e' title 'Cachet, calibrated q4_0 (cq4: read as q4_0 is)', \
     '' using ($1+$4*0.07):($2*10**($5*0.09)):3 with labels font ',10' tc rgb '#ff7f0e' notitle, \
     $gear using 1:2 with points pt 15 ps 1.4 lc rgb '#8c564b' title 'Cachet, calibrated GEAR (gear4: q4_0 + rank-4 correction)', \
     '' using ($1+$4*0.07):($2*10**($5*0.09)):3 with labels font ',10' tc rgb '#8c564b' notitle, \
     $llama using 1:2 with points pt 9 ps 1.6 lc rgb '#2ca02c' title 'llama.cpp (its own windows)', \
     '' using ($1+$4*0.07):($2*10**($5*0.09)):3 with labels font ',10' tc rgb '#2ca02c' notitle
