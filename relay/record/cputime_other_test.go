//go:build !unix

package record

import "time"

func processCPU() time.Duration { return 0 }
