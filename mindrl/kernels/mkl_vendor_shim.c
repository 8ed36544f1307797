int mkl_serv_intel_cpu_true(void) { return 1; }
