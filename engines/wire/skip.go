package wire

import "fmt"

// SkipValue returns the offset just past the msgpack value that starts at
// p[pos]. It walks nested arrays and maps with a counter of values still to
// read instead of recursing, so its memory is constant whatever the nesting
// depth, and it refuses a declared length or count that exceeds the bytes
// left before doing any work for it. An error wraps ErrUndecodable.
func SkipValue(p []byte, pos int) (int, error) {
	if pos < 0 || pos > len(p) {
		return pos, fmt.Errorf("%w: skip at offset %d of %d bytes", ErrUndecodable, pos, len(p))
	}
	end, err := skipAt(p, pos)
	if err != nil {
		return end, fmt.Errorf("%w: skipping a value at offset %d: %v", ErrUndecodable, pos, err)
	}
	return end, nil
}
